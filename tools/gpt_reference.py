#!/usr/bin/python3
"""PyTorch reference for Tessera's GPT-2 (models/gpt/model.h): loss, logits and gradients.

    /usr/bin/python3 tools/gpt_reference.py INPUT.safetensors -o GOLDEN.safetensors

INPUT holds a Tessera Gpt state dict (names as `wte.weight`, `h.0.attn.c_attn.weight`, ...,
either bare or prefixed `param.`), a batch `idx` and `targets` (i64 [B, T]), and the config
as metadata (layers, heads, width, context, vocab); --layers etc. override or supply it. The
script builds the same model in float32 (its own module code below, written to the same
equations as the C++), runs forward and backward once with dropout off, and writes GOLDEN:

    param.<name>   the parameters it was given       idx, targets   the batch
    loss           0-d f32 mean cross-entropy        logits         [B, T, vocab] f32
    grad.<name>    d loss / d parameter, for every parameter (wte's includes the tied head)

plus the config as metadata. GOLDEN is itself a valid INPUT, so the expected values can be
recomputed from the committed file alone.

Regenerating tests/models/testdata/gpt_golden.safetensors (after a change to the model's
init, the test's config or its batch), from the repository root:

    bazel build //tests/models:gpt_golden_test
    TESSERA_GPT_GOLDEN_INPUTS=/tmp/gpt_in.safetensors bazel-bin/tests/models/gpt_golden_test
    /usr/bin/python3 tools/gpt_reference.py /tmp/gpt_in.safetensors \
        -o tests/models/testdata/gpt_golden.safetensors

The test binary writes its seeded model's parameters and its batch to the file named by
TESSERA_GPT_GOLDEN_INPUTS before comparing (that comparison fails while the golden is stale).

The safetensors format is read and written with struct and json only (as
tools/safetensors_check.py does): 8-byte little-endian header length, JSON header, raw data.
"""

import argparse
import json
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_check import DTYPES, FormatError, read_safetensors  # noqa: E402

CONFIG_FIELDS = ("layers", "heads", "width", "context", "vocab")
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def write_safetensors(path, tensors, metadata):
    """Writes {name: tensor} (sorted by name, contiguous little-endian) and string metadata."""
    header = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # data section 8-byte aligned, as the format recommends
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data)
    os.replace(tmp, path)


# ---- the model: the equations of models/gpt/model.cc, in torch ---------------------------------

class Attention(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = torch.nn.Linear(width, 3 * width)
        self.c_proj = torch.nn.Linear(width, width)

    def forward(self, x):
        batch, steps, width = x.shape
        head_dim = width // self.heads
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, steps, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
        visible = torch.ones(steps, steps, dtype=torch.bool).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
        y = scores.softmax(dim=-1) @ v                               # [B, H, T, hd]
        return self.c_proj(y.transpose(1, 2).reshape(batch, steps, width))


class FeedForward(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.c_fc = torch.nn.Linear(width, 4 * width)
        self.c_proj = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Layer(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln_2 = torch.nn.LayerNorm(width)
        self.mlp = FeedForward(width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt2(torch.nn.Module):
    def __init__(self, layers, heads, width, context, vocab):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(context, width)
        self.h = torch.nn.ModuleList(Layer(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for layer in self.h:
            x = layer(x)
        return self.ln_f(x) @ self.wte.weight.t()  # the head is the token embedding


# ---- driver -------------------------------------------------------------------------------------

def load_inputs(path, overrides):
    tensors, metadata = read_safetensors(path)
    config = {}
    for field in CONFIG_FIELDS:
        value = overrides.get(field)
        if value is None and field in metadata:
            value = int(metadata[field])
        if value is None:
            raise SystemExit(f"gpt_reference: {path} has no '{field}' metadata; pass --{field}")
        config[field] = value
    for key in ("idx", "targets"):
        if key not in tensors:
            raise SystemExit(f"gpt_reference: {path} has no '{key}' tensor")
    skip = {"idx", "targets", "loss", "logits"}
    state = {}
    for name, t in tensors.items():
        if name in skip or name.startswith("grad."):
            continue
        state[name[len("param."):] if name.startswith("param.") else name] = t
    return config, state, tensors["idx"], tensors["targets"]


def reference(config, state, idx, targets):
    """Returns (model, loss, logits) with every parameter's .grad filled."""
    model = Gpt2(**config)
    expected = set(model.state_dict())
    if set(state) != expected:
        raise SystemExit("gpt_reference: parameter names differ: missing "
                         f"{sorted(expected - set(state))}, unexpected {sorted(set(state) - expected)}")
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    logits = model(idx.to(torch.int64))
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.to(torch.int64).reshape(-1))
    loss.backward()
    return model, loss, logits


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("input", help="safetensors with the parameters, idx, targets (and config)")
    parser.add_argument("-o", "--output", required=True, help="golden safetensors to write")
    for field in CONFIG_FIELDS:
        parser.add_argument(f"--{field}", type=int)
    args = parser.parse_args()
    try:
        config, state, idx, targets = load_inputs(args.input, vars(args))
    except (OSError, ValueError, KeyError, FormatError) as e:
        print(f"gpt_reference: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(0)  # the module constructors draw (values are replaced by the state)
    model, loss, logits = reference(config, state, idx, targets)

    out = {"idx": idx, "targets": targets, "loss": loss.detach().reshape(()),
           "logits": logits.detach()}
    for name, p in model.named_parameters():
        out[f"param.{name}"] = p.detach()
        out[f"grad.{name}"] = p.grad
    metadata = dict(config)
    metadata["torch"] = torch.__version__
    write_safetensors(args.output, out, metadata)
    print(f"gpt_reference: loss {loss.item():.9g}, {len(state)} parameters, wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

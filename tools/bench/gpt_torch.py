"""PyTorch peer of `bazel run //models:gpt`: the same byte-level GPT-2 (the module of
tools/gpt_reference.py: token + position embeddings, pre-LN blocks of causal self-attention
with fused qkv and a 4x tanh-GELU MLP, final LN, head tied to wte; GPT-2 init N(0, 0.02),
residual projections N(0, 0.02/sqrt(2L)), zero biases), the same bytes (models/data/text.cc:
the fortunes directory's regular, non-symlink, non-.dat, non-binary files sorted by path and
concatenated, the first 90% for training), batch, context, AdamW (betas 0.9/0.95, weight decay
on 2-D+ parameters only), gradient clipping and warmup + cosine schedule, for a side-by-side
training-throughput comparison. Windows are random (not Tessera's Philox stream): throughput
is what this measures.

    /usr/bin/python3 tools/bench/gpt_torch.py --steps=100 --threads=2
    /usr/bin/python3 tools/bench/gpt_torch.py --experts=8 --moe_top_k=2 --moe_every=2 --moe_hidden=256

Prints one JSON line per --log_every steps, as Tessera's --metrics lines:
{"framework": "pytorch", "step", "loss", "lr", "tokens_per_s"} (tokens/s over the steps of
that window: data, forward, backward, clipping, optimizer step and loss.item()).
Run with Debian's /usr/bin/python3 (python3-torch + libopenblas0-pthread).
"""
import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn


# ---- data: models/data/text.cc's rules ---------------------------------------------------------

def corpus_files(path):
    if not os.path.isdir(path):
        return [path]
    found = []
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in files:
            full = os.path.join(root, name)
            if os.path.islink(full) or not os.path.isfile(full) or name.endswith(".dat"):
                continue
            with open(full, "rb") as f:
                if b"\0" in f.read(8000):
                    continue
            found.append(full)
    return sorted(found, key=os.fsencode)  # by the path's bytes


def load_train_bytes(path):
    data = b"".join(open(p, "rb").read() for p in corpus_files(path))
    if not data:
        raise SystemExit(f"gpt_torch: no bytes under {path}")
    cut = int(0.9 * len(data))  # kTrainFraction
    return torch.frombuffer(bytearray(data[:cut]), dtype=torch.uint8)


# ---- the model: tools/gpt_reference.py's module ------------------------------------------------

class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        batch, steps, width = x.shape
        head_dim = width // self.heads
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, steps, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
        visible = torch.ones(steps, steps, dtype=torch.bool).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(batch, steps, width))


class FeedForward(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class MixtureOfExperts(nn.Module):
    """nn/moe.h's dropless layer as PyTorch users write it (Hugging Face's Mixtral block): an
    f32 router, softmax, top-k gates renormalised, a loop over the experts gathering each one's
    tokens (torch.where) and adding its weighted outputs back (index_add_), and the
    Switch/GShard balancing loss alpha E sum f_i P_i, kept in self.aux for the step's loss."""

    def __init__(self, width, experts, top_k, hidden, alpha):
        super().__init__()
        self.experts, self.top_k, self.alpha = experts, top_k, alpha
        self.router = nn.Parameter(torch.empty(experts, width))
        self.fc_weight = nn.Parameter(torch.empty(experts, width, hidden))
        self.fc_bias = nn.Parameter(torch.zeros(experts, hidden))
        self.proj_weight = nn.Parameter(torch.empty(experts, hidden, width))
        self.proj_bias = nn.Parameter(torch.zeros(experts, width))
        self.aux = torch.zeros(())

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = (flat.float() @ self.router.t()).softmax(dim=-1)
        gates, chosen = probs.topk(self.top_k, dim=-1)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            h = F.gelu(flat[token] @ self.fc_weight[e] + self.fc_bias[e], approximate="tanh")
            y = h @ self.proj_weight[e] + self.proj_bias[e]
            out.index_add_(0, token, y * gates[token, slot, None])
        counts = torch.bincount(chosen.flatten(), minlength=self.experts).float()
        fraction = counts / (flat.shape[0] * self.top_k)
        self.aux = self.alpha * self.experts * (fraction * probs.mean(dim=0)).sum()
        return out.view_as(x)


class Layer(nn.Module):
    def __init__(self, width, heads, moe=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MixtureOfExperts(width, *moe) if moe else FeedForward(width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt2(nn.Module):
    def __init__(self, layers, heads, width, context, vocab=256, moe=None, moe_every=1):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(
            Layer(width, heads, moe if moe and i % moe_every == moe_every - 1 else None)
            for i in range(layers))
        self.ln_f = nn.LayerNorm(width)
        # GPT-2 init, as Gpt::init_weights (LayerNorm keeps its 1 / 0).
        for name, p in self.named_parameters():
            if name.endswith("proj_weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            elif name.endswith("router") or name.endswith("fc_weight"):
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            elif name.endswith(".weight") and p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith(".bias") and ".ln_" not in name and not name.startswith("ln_"):
                nn.init.zeros_(p)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for layer in self.h:
            x = layer(x)
        return self.ln_f(x) @ self.wte.weight.t()

    def aux_loss(self):
        return sum((l.mlp.aux for l in self.h if isinstance(l.mlp, MixtureOfExperts)), torch.zeros(()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min_lr_ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default="/usr/share/games/fortunes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", type=int, default=0, help="Mixture of Experts (0: dense MLPs)")
    p.add_argument("--moe_top_k", type=int, default=2)
    p.add_argument("--moe_every", type=int, default=2)
    p.add_argument("--precision", choices=("f32", "bf16"), default="f32",
                   help="bf16: the forward and the loss under torch.autocast (as gpt --precision=bf16)")
    p.add_argument("--moe_hidden", type=int, default=0, help="0: 4 x width")
    p.add_argument("--aux_loss", type=float, default=0.01)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    data = load_train_bytes(a.data)
    moe = None
    if a.experts > 0:
        moe = (a.experts, a.moe_top_k, a.moe_hidden or 4 * a.width, a.aux_loss)
    model = Gpt2(a.layers, a.heads, a.width, a.context, moe=moe, moe_every=a.moe_every)
    model.train()
    params = list(model.parameters())
    decay = [q for q in params if q.dim() >= 2]
    no_decay = [q for q in params if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    warmup = min(a.warmup, a.steps // 2)
    min_lr = a.lr * a.min_lr_ratio

    def lr_at(step):  # optim::WarmupCosineLr
        if step < warmup:
            return a.lr * (step + 1) / warmup
        if step >= a.steps:
            return min_lr
        r = (step - warmup) / (a.steps - warmup)
        return min_lr + (a.lr - min_lr) * 0.5 * (1 + math.cos(math.pi * r))

    offsets = torch.arange(a.context + 1)
    tokens_per_step = a.batch * a.context
    window_s, window_steps = 0.0, 0
    for step in range(a.steps):
        t0 = time.perf_counter()
        starts = torch.randint(0, len(data) - a.context, (a.batch, 1))
        w = data[starts + offsets].long()
        idx, targets = w[:, :-1], w[:, 1:]
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            logits = model(idx)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        (loss + model.aux_loss()).backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, a.clip)
        opt.step()
        loss_value = loss.item()  # as Tessera's loop reads the loss every step
        window_s += time.perf_counter() - t0
        window_steps += 1
        if (step + 1) % a.log_every == 0 or step + 1 == a.steps:
            print(json.dumps({"framework": "pytorch", "step": step + 1, "loss": loss_value,
                              "lr": lr, "tokens_per_s": window_steps * tokens_per_step / window_s}),
                  flush=True)
            window_s, window_steps = 0.0, 0


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Independent reader for safetensors files, to cross-check Tessera's writer (nn/safetensors.cc).

    /usr/bin/python3 tools/safetensors_check.py model.safetensors            # names, shapes, sums
    /usr/bin/python3 tools/safetensors_check.py model.safetensors --expect expect.json

It follows the published format with only struct, json and torch.frombuffer (Debian's
python3-torch; the pip `safetensors` package is not needed): an 8-byte little-endian header
length N, N bytes of JSON, then the data, whose byte ranges must tile the rest of the file.

expect.json: {"tensors": {name: {"dtype": "F32", "shape": [2, 3], "values": [...]}},
              "metadata": {key: value}}     (values flattened in row-major order; bools as
0/1). Values are compared exactly: f16/bf16 expectations are the exact values of the stored
numbers. Exit status: 0 match, 1 mismatch, 2 unreadable or malformed file.
"""

import argparse
import json
import struct
import sys

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class FormatError(Exception):
    pass


def read_safetensors(path):
    """Returns ({name: tensor}, {metadata}); raises FormatError on anything off-spec."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise FormatError(f"{path}: {len(blob)} bytes, shorter than the header length field")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise FormatError(f"{path}: header length {n} exceeds the file")
    header = json.loads(blob[8 : 8 + n].decode("utf-8"))
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    data = blob[8 + n :]
    ranges = sorted((info["data_offsets"][0], info["data_offsets"][1], name)
                    for name, info in header.items())
    end = 0
    for begin, stop, name in ranges:
        if begin != end:
            raise FormatError(f"{path}: tensor {name!r} starts at {begin}, expected {end}")
        end = stop
    if end != len(data):
        raise FormatError(f"{path}: tensors cover {end} data bytes, the file has {len(data)}")
    if sys.byteorder != "little":
        raise FormatError("this checker assumes a little-endian host")

    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise FormatError(f"{path}: tensor {name!r} has unknown dtype {info['dtype']!r}")
        dtype = DTYPES[info["dtype"]]
        shape = list(info["shape"])
        begin, stop = info["data_offsets"]
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if stop - begin != numel * itemsize:
            raise FormatError(f"{path}: tensor {name!r} shape {shape} needs {numel * itemsize} "
                              f"bytes, offsets span {stop - begin}")
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            # bytearray: frombuffer warns on read-only buffers, and the tensor must own its data.
            t = torch.frombuffer(bytearray(data[begin:stop]), dtype=dtype).reshape(shape)
        tensors[name] = t
    return tensors, metadata


def describe(tensors, metadata):
    for name in sorted(tensors):
        t = tensors[name]
        total = t.to(torch.float64).sum().item() if t.numel() else 0.0
        print(f"{name}\t{str(t.dtype).replace('torch.', '')}\t{list(t.shape)}\tsum={total!r}")
    for key in sorted(metadata):
        print(f"__metadata__\t{key}={metadata[key]!r}")


def compare(tensors, metadata, expect):
    errors = []
    want = expect.get("tensors", {})
    if sorted(want) != sorted(tensors):
        errors.append(f"tensor names differ: file {sorted(tensors)}, expected {sorted(want)}")
    for name in sorted(set(want) & set(tensors)):
        t, w = tensors[name], want[name]
        if t.dtype != DTYPES[w["dtype"]]:
            errors.append(f"{name}: dtype {t.dtype}, expected {w['dtype']}")
            continue
        if list(t.shape) != list(w["shape"]):
            errors.append(f"{name}: shape {list(t.shape)}, expected {w['shape']}")
            continue
        flat = t.reshape(-1)
        if t.dtype in (torch.int64, torch.int32, torch.bool):
            # Integers compared as int64: f64 would round values beyond 2^53.
            got = flat.to(torch.int64)
            ref = torch.tensor([int(v) for v in w["values"]], dtype=torch.int64)
        else:
            got = flat.to(torch.float64)
            ref = torch.tensor(w["values"], dtype=torch.float64)
        if got.numel() != ref.numel() or not torch.equal(got, ref):
            bad = next((i for i in range(min(got.numel(), ref.numel())) if got[i] != ref[i]), None)
            errors.append(f"{name}: values differ (first at flat index {bad}: "
                          f"{got[bad].item() if bad is not None else '-'} vs "
                          f"{ref[bad].item() if bad is not None else '-'}; "
                          f"{got.numel()} vs {ref.numel()} values)")
    if "metadata" in expect and expect["metadata"] != metadata:
        errors.append(f"metadata {metadata} != expected {expect['metadata']}")
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("file")
    parser.add_argument("--expect", help="JSON file with the expected tensors and metadata")
    args = parser.parse_args()
    try:
        tensors, metadata = read_safetensors(args.file)
    except (OSError, ValueError, KeyError, TypeError, FormatError) as e:
        print(f"safetensors_check: {e}", file=sys.stderr)
        return 2
    describe(tensors, metadata)
    if args.expect:
        with open(args.expect) as f:
            expect = json.load(f)
        errors = compare(tensors, metadata, expect)
        for e in errors:
            print(f"MISMATCH {e}", file=sys.stderr)
        if errors:
            return 1
        print(f"OK: {len(tensors)} tensors and metadata match {args.expect}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Exit 0 when two safetensors files hold the same tensors bit for bit (names, dtypes, shapes
and data bytes; the metadata, which carries each save's checkpoint id, is not compared), 1
when they differ (naming the first difference), 2 when a file is unreadable.

    /usr/bin/python3 tests/models/same_tensors.py a.safetensors b.safetensors

Only struct and json: an independent reader, not Tessera's.
"""

import json
import struct
import sys


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    body = data[8 + n :]
    return {
        name: (info["dtype"], info["shape"], body[info["data_offsets"][0] : info["data_offsets"][1]])
        for name, info in header.items()
    }


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    try:
        a, b = read(sys.argv[1]), read(sys.argv[2])
    except (OSError, ValueError, KeyError, struct.error) as e:
        print(f"same_tensors: cannot read: {e}")
        return 2
    if sorted(a) != sorted(b):
        print(f"same_tensors: different names: {sorted(set(a) ^ set(b))}")
        return 1
    for name in sorted(a):
        if a[name] != b[name]:
            print(f"same_tensors: tensor '{name}' differs ({a[name][0]} {a[name][1]} vs "
                  f"{b[name][0]} {b[name][1]})")
            return 1
    print(f"same_tensors: {len(a)} tensors identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())

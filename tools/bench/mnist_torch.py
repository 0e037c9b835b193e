"""PyTorch peer of `bazel run //models:mnist`: the same MLP / CNN (layer for layer), data,
normalisation, batch, AdamW (weight decay on weights only), warmup + cosine schedule and
drop_last shuffling, for a side-by-side training-throughput comparison.

    /usr/bin/python3 tools/bench/mnist_torch.py --model=mlp --epochs=2 --threads=2

Prints one JSON line per epoch: {"framework": "pytorch", "model", "epoch", "samples_per_s",
"accuracy"}. Run with Debian's /usr/bin/python3 (python3-torch + libopenblas0-pthread).
"""
import argparse
import gzip
import json
import math
import struct
import time

import numpy as np
import torch
from torch import nn

MEAN, STD = 0.2860, 0.3530  # as models/data/idx.h


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(directory, train):
    prefix = "train" if train else "t10k"
    images = read_idx(f"{directory}/{prefix}-images-idx3-ubyte.gz").astype(np.float32)
    labels = read_idx(f"{directory}/{prefix}-labels-idx1-ubyte.gz").astype(np.int64)
    x = (torch.from_numpy(images) / 255.0 - MEAN) / STD
    return x.unsqueeze(1).contiguous(), torch.from_numpy(labels)


def make_model(name):
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train_limit", type=int, default=0, help="first N training images (0: all)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    xtr, ytr = load(a.data, True)
    if a.train_limit > 0:
        xtr, ytr = xtr[:a.train_limit], ytr[:a.train_limit]
    xte, yte = load(a.data, False)
    model = make_model(a.model)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr)
    steps_per_epoch = len(xtr) // a.batch
    total = a.epochs * steps_per_epoch
    warmup = min(a.warmup, total // 2)
    min_lr = a.lr * 0.05

    def lr_at(step):  # the same shape as optim::WarmupCosineLr
        if step < warmup:
            return a.lr * (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_lr + 0.5 * (a.lr - min_lr) * (1 + math.cos(math.pi * t))

    step = 0
    for epoch in range(a.epochs):
        model.train()
        perm = torch.randperm(len(xtr))
        t0 = time.perf_counter()
        for i in range(steps_per_epoch):
            idx = perm[i * a.batch:(i + 1) * a.batch]
            x, y = xtr[idx], ytr[idx]
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            loss.item()  # as Tessera's loop reads the loss every step
            step += 1
        seconds = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            correct = sum((model(xte[s:s + 1000]).argmax(1) == yte[s:s + 1000]).sum().item()
                          for s in range(0, len(xte), 1000))
        print(json.dumps({"framework": "pytorch", "model": a.model, "epoch": epoch + 1,
                          "samples_per_s": steps_per_epoch * a.batch / seconds,
                          "accuracy": correct / len(xte)}), flush=True)


if __name__ == "__main__":
    main()

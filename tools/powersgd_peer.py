#!/usr/bin/python3
"""PyTorch's own PowerSGD on the gradients of Tessera's PowerSGD test fixture.

Runs torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook (DDP on gloo, CPU, f64) on
--ranks processes, with the parameters, per-rank gradients and initial Qs of
tests/parallel/powersgd_reference.cc, and writes rank 0's reduced gradients per round as
JSON: {"grads": [[[values of each parameter, registration order] per round]]}. The
gradients are set through the loss sum(p * G) (DDP's forward), whose gradient is G exactly; the initial Qs
replace the hook's torch.randn draw (keyed by shape: the fixture's compressed matrices have
distinct shapes).

    /usr/bin/python3 tools/powersgd_peer.py --rank 1 --rounds 6 --start 2 --out /tmp/peer.json

Debian's python3-torch (import only under /usr/bin/python3).
"""
import argparse
import json
import math
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

# The fixture (tests/parallel/powersgd_reference.cc): registration order, and each compressed
# matrix's index in Tessera's bucket (reverse registration order: kernel, w3, bias, w1).
SHAPES = [("w1", (16, 12)), ("bias", (16,)), ("w3", (4, 3)), ("kernel", (6, 4, 5))]
BUCKET_INDEX = {"kernel": 0, "w3": 1, "bias": 2, "w1": 3}


def grad_values(rank, t, k, n):
    return [math.sin(0.37 * float(i + 1) * float(k + 1) + 1.3 * rank + 0.71 * t) + 0.1 * float(rank - t)
            for i in range(n)]


def q0_of(bucket, tensor, rows, cols):
    return [math.cos(0.9 * float(i) + 0.3 * tensor + 0.1 * bucket) for i in range(rows * cols)]


class Params(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for name, shape in SHAPES:
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64)))

    def forward(self, grads):
        """sum(p * G) over the parameters: its gradient is G."""
        return sum((getattr(self, name) * g).sum() for (name, _), g in zip(SHAPES, grads))


def worker(rank, args, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.set_num_threads(1)
    model = Params()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                               start_powerSGD_iter=args.start, min_compression_rate=2,
                               use_error_feedback=True, warm_start=True,
                               orthogonalization_epsilon=0)
    ddp.register_comm_hook(state, psgd.powerSGD_hook)

    # The hook draws each initial Q with torch.randn(1, m, r); the fixture's Q0 instead.
    by_cols = {}
    for name, shape in SHAPES:
        if len(shape) >= 2:
            by_cols[math.prod(shape[1:])] = BUCKET_INDEX[name]
    real_randn = torch.randn

    def fixture_randn(*shape, device=None, dtype=None, **kwargs):
        if len(shape) == 3 and shape[0] == 1 and shape[1] in by_cols:
            values = q0_of(0, by_cols[shape[1]], shape[1], shape[2])
            return torch.tensor(values, dtype=dtype).view(*shape)
        return real_randn(*shape, device=device, dtype=dtype, **kwargs)

    torch.randn = fixture_randn
    rounds = []
    for t in range(args.rounds):
        grads = [torch.tensor(grad_values(rank, t, k, math.prod(shape)), dtype=torch.float64).view(shape)
                 for k, (_, shape) in enumerate(SHAPES)]
        for p in model.parameters():
            p.grad = None
        ddp(grads).backward()  # through DDP's forward, so that its reducer runs the hook
        rounds.append([getattr(model, name).grad.reshape(-1).tolist() for name, _ in SHAPES])
    torch.randn = real_randn
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"grads": rounds}, f)
    dist.barrier()
    # Leave without tearing gloo down: its destructors sometimes abort ("terminate called
    # without an active exception") after all the work is done, failing the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rank", type=int, default=1, help="matrix_approximation_rank")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--start", type=int, default=2, help="start_powerSGD_iter")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=args.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

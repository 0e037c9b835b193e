#!/usr/bin/env python3
"""Peer check of Tessera's Adafactor (mode optax) against optax.adafactor itself.

    bazel run //tools/bench:adafactor_dump > /tmp/tessera.jsonl
    python3 tools/adafactor_peer.py /tmp/tessera.jsonl     # needs: pip install jax optax
    python3 tools/adafactor_peer.py /tmp/tessera.jsonl --exact_decay

Runs optax.adafactor in float64 (jax x64) on the same formula-made parameters and gradients as
tools/bench/adafactor_dump.cc, with the same settings (lr 1e-2, decay_rate 0.8, clipping 1.0,
eps 1e-30, min_dim_size_to_factor 3, momentum / weight decay / parameter scale per case), and
prints the largest difference per case and shape after 6 steps. Exit status 1 when any
differs by more than the bound (below). Not part of CI (PyPI packages are optional peers).
"""

import json
import math
import sys

import jax
import jax.numpy as jnp
import optax

jax.config.update("jax_enable_x64", True)

# optax computes beta2_t = 1 - t^-0.8 from a float32 step count (factorized._decay_rate_pow),
# which alone moves its f64 results by ~1e-10. --exact_decay makes adafactor use an f64 copy
# of that function (scale_by_factored_rms's decay_rate_fn), so any remaining difference is the
# algorithm's; the bound is then 1e-13.
EXACT = "--exact_decay" in sys.argv
if EXACT:
    import functools

    from optax._src import alias, factorized

    def _decay_rate_pow_f64(i, exponent=0.8):
        t = jnp.array(i + 1, jnp.float64)
        return 1.0 - t ** (-exponent)

    alias.factorized.scale_by_factored_rms = functools.partial(
        factorized.scale_by_factored_rms, decay_rate_fn=_decay_rate_pow_f64)
BOUND = 1e-13 if EXACT else 1e-9


def initial(n):
    return [0.5 * math.sin(0.1 * i + 0.3) for i in range(n)]


def gradient(n, step):
    scale = 50.0 if step == 3 else 0.1
    return [scale * math.cos(0.37 * i + step) for i in range(n)]


CASES = {
    "plain": dict(momentum=None, weight_decay_rate=None, multiply_by_parameter_scale=True),
    "momentum_decay": dict(momentum=0.9, weight_decay_rate=0.1, multiply_by_parameter_scale=True),
    "no_param_scale": dict(momentum=None, weight_decay_rate=None, multiply_by_parameter_scale=False),
}


def main():
    ours = {}
    with open(sys.argv[1]) as f:
        for line in f:
            r = json.loads(line)
            ours[(r["case"], tuple(r["shape"]), r["step"])] = r["param"]
    worst = 0.0
    for case, kw in CASES.items():
        for shape in sorted({k[1] for k in ours if k[0] == case}):
            n = math.prod(shape)
            tx = optax.adafactor(learning_rate=1e-2, min_dim_size_to_factor=3, decay_rate=0.8,
                                 clipping_threshold=1.0, eps=1e-30, factored=True,
                                 dtype_momentum=jnp.float64, **kw)
            p = jnp.array(initial(n), dtype=jnp.float64).reshape(shape)
            state = tx.init(p)
            for step in range(6):
                g = jnp.array(gradient(n, step), dtype=jnp.float64).reshape(shape)
                updates, state = tx.update(g, state, p)
                p = optax.apply_updates(p, updates)
                diff = max(abs(a - b) for a, b in zip(p.reshape(-1).tolist(), ours[(case, shape, step)]))
                worst = max(worst, diff)
            print(f"{case:15s} {str(list(shape)):12s} max |tessera - optax| after 6 steps: {diff:.3g}")
    print(f"largest difference: {worst:.3g} (bound {BOUND:g})")
    return 0 if worst <= BOUND else 1


if __name__ == "__main__":
    sys.exit(main())

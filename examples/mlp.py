"""An MLP wrapped with ``@int8ify``: the rewritten program's dots, its error against float32, its speed.

    python examples/mlp.py [--batch 256] [--width 1024] [--layers 4]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_rewrite import default_platform, dot_eqns, int8ify, quantize_params


def init_mlp(key, width: int, layers: int):
    """He-initialised Dense layers ``{"w": (width, width), "b": (width,)}``."""
    params = []
    for k in jax.random.split(key, layers):
        params.append({"w": jax.random.normal(k, (width, width)) * np.sqrt(2.0 / width), "b": jnp.zeros((width,))})
    return params


def mlp(params, x):
    """Dense + gelu layers, the last one linear."""
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.gelu(x)
    return x


def dot_summary(jaxpr) -> list[str]:
    """One line per dot_general of a (possibly nested) jaxpr as this machine runs it: operand types and
    accumulation type."""
    return [
        f"{' x '.join(v.aval.str_short() for v in eqn.invars)} -> {eqn.outvars[0].aval.str_short()}"
        for eqn in dot_eqns(jaxpr, platform=default_platform())
    ]


def median_ms(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)

    params = init_mlp(jax.random.PRNGKey(0), args.width, args.layers)
    x = jax.random.normal(jax.random.PRNGKey(1), (args.batch, args.width))
    float_fn = jax.jit(mlp)
    int8_fn = jax.jit(int8ify(mlp))

    print(f"MLP: {args.layers} x Dense({args.width}) + gelu, batch {args.batch}")
    print("dots in the rewritten program:")
    for line in dot_summary(jax.make_jaxpr(int8ify(mlp))(params, x)):
        print("  " + line)
    y_float, y_int8 = float_fn(params, x), int8_fn(params, x)
    rel = float(jnp.linalg.norm(y_int8 - y_float) / jnp.linalg.norm(y_float))
    print(f"relative error vs float32 (Frobenius): {rel:.2e}")
    qparams = quantize_params(mlp, params, x)  # weights quantized once
    # interleave the variants so drift on a shared machine hits all alike
    variants = {"float32": params, "int8ify": params, "int8ify + quantize_params": qparams}
    times = {name: [] for name in variants}
    for _ in range(5):
        for name, p in variants.items():
            times[name].append(median_ms(float_fn if name == "float32" else int8_fn, p, x, repeats=5))
    f_ms = float(np.median(times["float32"]))
    for name in variants:
        ms = float(np.median(times[name]))
        print(f"{name:>26}: {ms:7.2f} ms   speed-up vs float32: {f_ms / ms:.2f}x")


if __name__ == "__main__":
    main()

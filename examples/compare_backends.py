"""Error of the int8, mxfp8 and nvfp4 backends on the same MLP, as a markdown table.

    python examples/compare_backends.py [--batch 128] [--width 256] [--layers 4] [--seed 0]

Each cell is the relative Frobenius error ``||y - y_f32|| / ||y_f32||`` of one layer's output (before its
gelu) when the whole network runs rewritten, against the float32 network. mxfp8/nvfp4 run through
``jax.nn.scaled_matmul`` (cuDNN on Blackwell GPUs; the documented math, emulated, elsewhere).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mlp import init_mlp  # noqa: E402

from jaxpr_rewrite import int8ify  # noqa: E402

BACKENDS = ("int8", "mxfp8", "nvfp4")


def mlp_layer_outputs(params, x):
    """``examples/mlp.py``'s ``mlp``, returning every layer's output (before its gelu)."""
    outs = []
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        outs.append(x)
        if i < len(params) - 1:
            x = jax.nn.gelu(x)
    return outs


def relative_errors(outs, ref) -> list[float]:
    return [float(jnp.linalg.norm(o - r) / jnp.linalg.norm(r)) for o, r in zip(outs, ref)]


def table(batch: int, width: int, layers: int, seed: int = 0) -> str:
    """The markdown table of per-layer relative errors, one row per backend."""
    params = init_mlp(jax.random.PRNGKey(seed), width, layers)
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (batch, width))
    ref = jax.jit(mlp_layer_outputs)(params, x)
    header = ["backend", *(f"layer {i + 1}" for i in range(layers - 1)), f"layer {layers} (output)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for backend in BACKENDS:
        outs = jax.jit(int8ify(mlp_layer_outputs, backend=backend))(params, x)
        lines.append(f"| {backend} | " + " | ".join(f"{e:.2e}" for e in relative_errors(outs, ref)) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"MLP: {args.layers} x Dense({args.width}) + gelu, batch {args.batch}, on {jax.devices()[0].device_kind}")
    print("relative Frobenius error vs float32, per layer output (whole network rewritten):\n")
    print(table(args.batch, args.width, args.layers, args.seed))


if __name__ == "__main__":
    main()

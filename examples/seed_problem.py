"""The seed problem, solved with the library: per-channel int8 matmul with its codes and scales.

    python examples/seed_problem.py

Runs the problem's three published examples through ``jax.jit(int8_matmul)``, prints each result next to
the expected one, and checks the traced program against the contract with ``verify``.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_rewrite import int8_matmul
from jaxpr_rewrite import verify

EXAMPLES = [
    ([[1.2, 2.0, -0.9]], [[0.5, -0.023], [-1.27, 0.011], [0.3, 0.041]], [[-2.210866, -0.042284]]),
    ([[0.0, 0.0], [0.5, 2.0]], [[0.8, 0.0, -0.31], [-0.45, 0.0, 0.66]], [[0.0, 0.0, 0.0], [-0.491339, 0.0, 1.162867]]),
    (
        [[1.0, 1.0, 1.0, 1.0], [0.7, -0.5, 0.3, 1.2]],
        [[0.5, 0.25], [0.5, -0.25], [0.5, 0.25], [0.5, 0.1]],
        [[2.0, 0.350394], [0.850394, 0.496063]],
    ),
]


def main():
    solve = jax.jit(int8_matmul)
    for i, (x, w, y_expected) in enumerate(EXAMPLES, 1):
        x, w = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
        out = solve(x, w)
        print(f"example {i}")
        for key in ("x_q", "x_scales", "w_q", "w_scales", "y"):
            print(f"  {key:9s} {np.round(np.asarray(out[key], np.float64), 6).tolist()}")
        ok = np.allclose(np.asarray(out["y"]), y_expected, rtol=1e-5, atol=1e-6)
        print(f"  y matches the published output: {ok}")
    findings = verify(int8_matmul, jnp.ones((3, 8)), jnp.ones((8, 4)))
    print("contract check (verify):", "clean" if not findings else "\n".join(map(str, findings)))


if __name__ == "__main__":
    main()

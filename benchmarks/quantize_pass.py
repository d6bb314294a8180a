"""One quantization pass over an activation, timed on this device: int8ify's exact codes against the plain formula
and the memory floor, for a device whose time the compiler's cost model misjudges.

    python benchmarks/quantize_pass.py [--quick]

On a TPU v5e chip the MLP at d 4096 with dynamic scales took 1.3x the hand-written program's time, which XLA's cost
model estimates within 1%; the model prices int8ify's quantization pass (about 30 vector operations per element)
at 2% over the plain one (about 8). This times the pass alone. Each slice's scale parts come first, outside the
timed pass; every variant maps ``x`` to int8 codes under ``jax.jit``, timed interleaved (medians):

* ``int8ify``: the codes int8ify computes on this platform (``exact_division.rounded_quotients``, then the clip);
* ``exact, per-slice parts`` and ``exact, per-element parts``: the TPU's two forms of the exact comparison with the
  rounding boundary (``exact_division.tpu_quotients_per_slice_parts`` and ``tpu_quotients_per_element_parts``; a
  TPU's int8ify takes one of them, ``tpu_per_slice_parts`` choosing by the layout); their codes are checked against
  int8ify's on this device, bit for bit, on data full of rounding ties;
* ``plain division``: ``clip(round(x / s))`` as XLA compiles it (off by one code on some ties);
* ``memory floor``: ``int8(x * 2)``, the same bytes read and written with next to no arithmetic.

``benchmarks/device_check.py`` runs it in its ``exactness`` step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from jaxpr_rewrite._numerics.exact_division import (rounded_quotients, tpu_quotients_per_element_parts,  # noqa: E402
                                          tpu_quotients_per_slice_parts)
from jaxpr_rewrite._numerics.quantize import clipped_codes, scale_parts  # noqa: E402
from speed import time_interleaved  # noqa: E402

# (rows, row length): the MLP's activation at d 4096 and batch 4096; attention's probabilities at batch 128
# (128 x 12 heads x 128 queries, 128 keys each)
SHAPES = ((4096, 4096), (128 * 12 * 128, 128))
QUICK_SHAPES = ((256, 256),)
TABLE_HEADER = ["| rows x length | variant | ms | x memory floor | x plain division |", "|---|---|---|---|---|"]


def int8ify_codes(x, scales, prescale):
    return clipped_codes(rounded_quotients(x, scales, prescale, (0,)))


def exact_per_slice_codes(x, scales, prescale):
    return clipped_codes(tpu_quotients_per_slice_parts(x, scales, prescale, (0,)))


def exact_per_element_codes(x, scales, prescale):
    return clipped_codes(tpu_quotients_per_element_parts(x, scales, prescale, (0,)))


def plain_codes(x, scales, prescale):
    scale = lax.mul(scales, lax.div(np.float32(1), prescale))  # the slice's scale itself
    return clipped_codes(jnp.round(x / scale[:, None]))


def memory_floor(x, scales, prescale):
    return lax.convert_element_type(lax.mul(x, np.float32(2)), np.int8)


EXACT_FORMS = {"exact, per-slice parts": exact_per_slice_codes, "exact, per-element parts": exact_per_element_codes}
VARIANTS = {"int8ify": int8ify_codes, **EXACT_FORMS, "plain division": plain_codes, "memory floor": memory_floor}


def pass_rows(shapes, rounds: int, reps: int):
    """The table's rows (Markdown), one shape at a time; raises if an exact form's codes are not int8ify's."""
    rng = np.random.default_rng(0)
    parts = jax.jit(lambda v: scale_parts(jnp.max(jnp.abs(v), axis=1))[0::2])
    fns = {name: jax.jit(fn) for name, fn in VARIANTS.items()}
    for rows, length in shapes:
        ties = jnp.asarray(rng.integers(-300, 300, size=(rows, length)) / 4.0, jnp.float32)  # rich in ties
        x = jnp.asarray(rng.normal(size=(rows, length)), jnp.float32)
        x_parts = parts(x)
        for data, data_parts in ((ties, parts(ties)), (x, x_parts)):
            want = np.asarray(fns["int8ify"](data, *data_parts))
            for name in EXACT_FORMS:
                got = np.asarray(fns[name](data, *data_parts))
                if not np.array_equal(got, want):
                    raise AssertionError(f"{name}: codes differ from int8ify's in {int((got != want).sum())} places")
        times = time_interleaved({name: (fn, (x, *x_parts)) for name, fn in fns.items()}, rounds, reps)
        for name, ms in times.items():
            yield (f"| {rows} x {length} | {name} | {ms:.3f} | {ms / times['memory floor']:.2f} | "
                   f"{ms / times['plain division']:.2f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small shape, few rounds")
    ns = parser.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; medians of interleaved runs")
    print("\n".join(TABLE_HEADER), flush=True)
    for row in pass_rows(QUICK_SHAPES if ns.quick else SHAPES, *((3, 2) if ns.quick else (9, 10))):
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""all-MiniLM-L6-v2 quantized once, shipped as a file, loaded and run from that file alone.

    python examples/minilm/deploy.py save minilm-int8.safetensors             # quantize the encoder, write it
    python examples/minilm/deploy.py save minilm-int4.safetensors --bits 4    # W4A8: 4-bit weights
    python examples/minilm/deploy.py save minilm-b64.safetensors --bits 4 --block-size 64  # scales per 64
    python examples/minilm/deploy.py save minilm-int8.orbax                   # an Orbax checkpoint instead
    python examples/minilm/deploy.py run minilm-int8.safetensors              # load it, embed, check accuracy

``save`` loads the float32 weights from the model package, quantizes them as ``run.py`` does (SmoothQuant
alpha 0.5, calibrated on ``run.py``'s calibration sentences; ``--bits 32`` writes the float32 params unquantized,
for comparison; ``--block-size`` gives one scale per column and block of that many inputs, the program then
running ``int8ify(..., block_size=...)``) and writes them with
:func:`~jaxpr_rewrite.safetensors_io.save_safetensors` (a ``.safetensors`` name) or
:func:`~jaxpr_rewrite.checkpoint.save_quantized` (any other name: an Orbax checkpoint directory).
``run`` reads that file alone (the model package provides only the tokenizer), embeds the sentences of
``reference_embeddings.npz`` and prints the cosine of each embedding to sentence-transformers' own float32
embedding of it (recorded at 128 tokens, as here). Both print the file's size.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import model as minilm  # noqa: E402
import run as report  # noqa: E402  (run.py: its calibration sentences and the int8ify'd encoder it reports on)

try:
    from jaxpr_rewrite import int8ify, quantize_params
    from jaxpr_rewrite._io.checkpoint import load_quantized, save_quantized
    from jaxpr_rewrite._quantized.array import is_quantized
    from jaxpr_rewrite._io.safetensors_io import load_safetensors, save_safetensors
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(1, str(HERE.parents[1]))
    from jaxpr_rewrite import int8ify, quantize_params
    from jaxpr_rewrite._io.checkpoint import load_quantized, save_quantized
    from jaxpr_rewrite._quantized.array import is_quantized
    from jaxpr_rewrite._io.safetensors_io import load_safetensors, save_safetensors

REFERENCE = HERE / "reference_embeddings.npz"
REFERENCE_LENGTH = 128  # the tokens sentence-transformers embedded the reference sentences with
SMOOTH_ALPHA = 0.5


def is_safetensors(path: Path) -> bool:
    return path.suffix == ".safetensors"


def size_on_disk(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def encoder(block_size: int | None):
    """The int8ify'd encoder, block-scaled or not."""
    return int8ify(minilm.encode) if block_size is None else int8ify(minilm.encode, block_size=block_size)


def describe(bits: int, block_size: int | None) -> str:
    blocks = f", scales per block of {block_size}" if block_size is not None else ""
    return f"int{bits} weights{blocks}"


def save(path: Path, bits: int, block_size: int | None) -> None:
    """Quantize the pretrained encoder (``bits`` 8 or 4, per channel or per ``block_size``; 32: keep it float32)
    and write it to ``path``."""
    params = minilm.load_params()
    if bits == 32:
        tree = params
    else:
        calibration = minilm.tokenize(minilm.load_tokenizer(), report.CALIBRATION_SENTENCES)
        tree = quantize_params(encoder(block_size), params, *calibration, smooth_alpha=SMOOTH_ALPHA,
                               smooth_skip=("*/output",), bits=bits)
    if path.exists():
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (save_safetensors if is_safetensors(path) else save_quantized)(path, tree)
    kind = "float32" if bits == 32 else describe(bits, block_size)
    print(f"wrote {path} ({kind}): {size_on_disk(path) / 2**20:.1f} MiB")


def run(path: Path, batch_size: int) -> None:
    """Load ``path`` alone, embed the reference sentences, print the cosine to the recorded embeddings."""
    start = time.perf_counter()
    params = (load_safetensors if is_safetensors(path) else load_quantized)(path)
    loaded = time.perf_counter() - start
    reference = np.load(REFERENCE)
    sentences = [str(s) for s in reference["sentences"]]
    weights = {(leaf.bits, leaf.block_size) for leaf in jax.tree_util.tree_leaves(params, is_leaf=is_quantized)
               if is_quantized(leaf)}
    # float32 params (save --bits 32) run the float encoder, the baseline the quantized ones are measured against;
    # quantized ones the int8ify'd encoder with the block size they were quantized for
    (bits, block_size), = weights or {(32, None)}
    program = jax.jit(encoder(block_size) if weights else minilm.encode)
    embeddings = minilm.embed(program, params, minilm.load_tokenizer(), sentences, batch_size,
                              max_length=REFERENCE_LENGTH)
    cosines = report.row_cosine(embeddings, reference["embeddings"])
    kind = f"{describe(bits, block_size)}, int8ify" if weights else "float32, the float encoder"
    print(f"loaded {path} ({size_on_disk(path) / 2**20:.1f} MiB, {kind}) in {loaded:.2f} s; "
          f"{len(sentences)} sentences vs sentence-transformers' float32: cosine mean {cosines.mean():.5f}, "
          f"min {cosines.min():.5f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    save_command = commands.add_parser("save", help="quantize the encoder once and write it")
    save_command.add_argument("path", type=Path, help="a .safetensors file, or an Orbax checkpoint directory")
    save_command.add_argument("--bits", type=int, choices=(32, 8, 4), default=8,
                              help="weight bits: 8 (default), 4 (W4A8), or 32 (float32, unquantized)")
    save_command.add_argument("--block-size", type=int, default=None,
                              help="one scale per column and block of this many inputs (default: per column)")
    run_command = commands.add_parser("run", help="load a saved encoder and embed the reference sentences")
    run_command.add_argument("path", type=Path)
    run_command.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    if args.command == "save":
        if args.block_size is not None and (args.bits == 32 or args.block_size < 1):
            parser.error("--block-size needs --bits 8 or 4 and a positive size")
        save(args.path, args.bits, args.block_size)
    else:
        if not args.path.exists():
            parser.error(f"{args.path} does not exist (write it with: deploy.py save {args.path})")
        run(args.path, args.batch_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())

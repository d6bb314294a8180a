"""Pictures: Report.plot draws one bar per dot (its measured error), coloured by the rewrite's decision; the
plotting helpers fail with one sentence when matplotlib is missing."""

import builtins

import numpy as np
import pytest

from jaxpr_rewrite import Int8ifyError, int8ify
from jaxpr_rewrite import report
from jaxpr_rewrite._inspect.plotting import COLORS

matplotlib = pytest.importorskip("matplotlib")

rng = np.random.default_rng(9)
X = rng.normal(size=(16, 64)).astype(np.float32)
W1 = rng.normal(size=(64, 64)).astype(np.float32)
W2 = rng.normal(size=(64, 8)).astype(np.float32)
CODES = rng.integers(-127, 128, size=(4, 6)).astype(np.int8)


def model(x, w1, w2, codes):
    import jax
    import jax.numpy as jnp

    with jax.named_scope("encoder"):
        h = jax.nn.relu(x @ w1)
    with jax.named_scope("head"):
        out = h @ w2
    return out, jnp.matmul(codes, codes.T, preferred_element_type=jnp.int32)


def test_report_plot_has_one_bar_per_dot_with_its_error(tmp_path):
    rows = report(int8ify(model, skip="head"), X, W1, W2, CODES)
    fig = rows.plot(tmp_path / "errors.png")
    (ax,) = fig.axes
    bars = ax.patches[: len(rows)]
    assert len(bars) == 3
    np.testing.assert_allclose([b.get_height() for b in bars[:2]], [rows[0].error, rows[1].error])
    assert bars[2].get_height() == 0  # the integer dot: an empty slot
    colors = [matplotlib.colors.to_hex(b.get_facecolor()) for b in bars]
    assert colors == [COLORS["rewritten"], COLORS["kept"], COLORS["not measured"]]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[:2] == ["#0 encoder", "#1 head"]
    assert any("matches skip pattern 'head'" in t.get_text() for t in ax.texts)  # the option that kept it
    assert (tmp_path / "errors.png").stat().st_size > 1000


def test_plot_needs_measured_errors():
    import jax

    rows = report(model, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (X, W1, W2, CODES)))
    with pytest.raises(Int8ifyError, match="no measured errors to plot"):
        rows.plot()


def test_missing_matplotlib_is_one_sentence(monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    rows = report(model, X, W1, W2, CODES)
    with pytest.raises(Int8ifyError, match=r"plotting needs matplotlib.*pip install -e '\.\[plot\]'"):
        rows.plot()

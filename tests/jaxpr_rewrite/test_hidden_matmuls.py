"""Float matmuls out of the jaxpr's reach (JX105). cuDNN's fused attention (``jax.nn.dot_product_attention(
implementation="cudnn")``, the fast attention on the NVIDIA GPUs int8 is for) computes its matmuls inside one cuDNN
call, a ``jax.experimental.sparse`` matmul is one primitive over the stored values, and ``Exported.call`` runs a
StableHLO module. int8ify traced each without a word and left their matmuls float; now it refuses, naming the line
and what to call instead, unless a skip pattern keeps them float, and ``verify`` reports them."""

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

from helpers import assert_all_dots_int8
from jaxpr_rewrite import Int8ifyError, int8ify, quantize_params
from jaxpr_rewrite import verify

# JAX checks for cuDNN when it traces the call; the test machine has none, so the check is answered as a Hopper
# GPU with cuDNN 9.10 would answer it (JAX's own module: nothing of int8ify is patched).
_CUDNN_ATTENTION = "jax._src.cudnn.fused_attention_stablehlo"


@pytest.fixture
def cudnn_tracing(monkeypatch):
    try:
        module = importlib.import_module(_CUDNN_ATTENTION)
        monkeypatch.setattr(module, "check_cudnn_version", lambda: 91000)
        monkeypatch.setattr(module, "check_compute_capability", lambda capability: True)
    except (ImportError, AttributeError) as error:
        pytest.skip(f"this JAX traces cuDNN attention differently ({error})")


def _inputs():
    q, k, v = np.random.default_rng(0).standard_normal((3, 2, 16, 4, 64)).astype(jnp.bfloat16)
    return q, k, v, np.random.default_rng(1).standard_normal((256, 32)).astype(jnp.bfloat16)


def _block(q, k, v, w, implementation="cudnn"):
    with jax.named_scope("attention"):
        out = jax.nn.dot_product_attention(q, k, v, implementation=implementation)
    return out.reshape(2, 16, 256) @ w


ADVICE = (r"compute the matmuls where int8ify rewrites them: jax\.nn\.dot_product_attention with "
          r"implementation='xla' \(or None\), a sparse operand made dense \(\.todense\(\)\), a program exported "
          r"from its int8ified function")


def test_cudnn_attention_is_refused_with_the_line_and_the_fix(cudnn_tracing):
    with pytest.raises(Int8ifyError) as error:
        int8ify(_block).rewritten_jaxpr(*_inputs())
    message = str(error.value)
    assert re.search(r"primitive 'dot_product_attention_fwd_wrapper' at \S*test_hidden_matmuls\.py:\d+ \(_block\) "
                     r"is cuDNN's fused attention", message), message
    assert re.search(r"out of int8ify's reach \(JX105\); " + ADVICE +
                     r"; or keep it float with a skip pattern matching its name scope 'attention'$", message), message
    # the fix it names: every matmul of the XLA implementation is an int8 dot
    jaxpr = int8ify(lambda *args: _block(*args, implementation="xla")).rewritten_jaxpr(*_inputs())
    assert_all_dots_int8(jaxpr, expected_count=3)


def test_a_skip_pattern_keeps_cudnn_attention_float(cudnn_tracing):
    jaxpr = int8ify(_block, skip=["attention*"]).rewritten_jaxpr(*_inputs())
    assert_all_dots_int8(jaxpr, expected_count=1)  # the projection after it


def test_the_gradient_program_is_refused_too(cudnn_tracing):
    q, k, v, w = _inputs()
    loss = jax.grad(lambda q: _block(q, k, v, w).astype(jnp.float32).sum())
    with pytest.raises(Int8ifyError, match=r"dot_product_attention_fwd_wrapper.*is cuDNN's fused attention"):
        int8ify(loss).rewritten_jaxpr(q)
    # the skip pattern keeps the forward and the backward cuDNN calls; the projection's dots are int8
    assert_all_dots_int8(int8ify(loss, skip=["attention*"]).rewritten_jaxpr(q))


def test_verify_reports_it_at_the_users_line(cudnn_tracing):
    findings = verify(_block, *_inputs())
    hidden = [f for f in findings if f.primitive == "dot_product_attention_fwd_wrapper"]
    assert len(hidden) == 1 and hidden[0].code == "JX105", findings
    assert hidden[0].file.endswith("test_hidden_matmuls.py") and hidden[0].line == _block.__code__.co_firstlineno + 2
    assert re.search(r"dot_product_attention_fwd_wrapper is cuDNN's fused attention .*: " + ADVICE + "$",
                     hidden[0].message), hidden[0].message
    assert verify(int8ify(_block, skip=["attention*"]), *_inputs())[0].primitive == "dot_product_attention_fwd_wrapper"


def _sparse_inputs():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    w[np.abs(w) < 1] = 0  # a pruned weight
    return w, rng.standard_normal((256, 16)).astype(np.float32)


def _pruned_dense(w, x):
    return jax.nn.relu(w @ x)  # the weight on the left: BCSR multiplies only there


@pytest.mark.parametrize("fmt", [sparse.BCOO, sparse.BCSR])
def test_a_sparse_matmul_is_refused_and_its_dense_weight_runs_in_int8(fmt):
    w, x = _sparse_inputs()
    with pytest.raises(Int8ifyError) as error:
        int8ify(_pruned_dense)(fmt.fromdense(w), x)
    assert re.search(r"primitive 'b(coo|csr)_dot_general' at \S*test_hidden_matmuls\.py:\d+ \(_pruned_dense\) is a "
                     r"matmul with a jax\.experimental\.sparse operand.*\(JX105\); " + ADVICE, str(error.value))
    assert [f.code for f in verify(_pruned_dense, fmt.fromdense(w), x)] == ["JX105"]
    # the fix it names: the weight made dense is an int8 dot, a pre-quantized one too
    assert_all_dots_int8(int8ify(_pruned_dense).rewritten_jaxpr(fmt.fromdense(w).todense(), x), expected_count=1)
    qw = quantize_params(_pruned_dense, w, x)
    assert_all_dots_int8(int8ify(_pruned_dense).rewritten_jaxpr(qw, x), expected_count=1)


def test_an_integer_sparse_matmul_is_left_alone():
    """Only float matmuls are the rewrite's: a sparse matmul of integers is neither refused nor reported."""
    w, x = _sparse_inputs()
    ints = np.sign(w).astype(np.int32)
    out = int8ify(lambda w, x: w @ x)(sparse.BCOO.fromdense(ints), x.astype(np.int32))
    np.testing.assert_array_equal(np.asarray(out), ints @ x.astype(np.int32))


def _dense(x, w):
    return jnp.tanh(x @ w)


def pipeline(exported, x, w):
    return exported.call(x, w) * 2


def test_an_exported_float_program_is_refused_and_an_exported_int8_program_passes():
    """``Exported.call`` runs StableHLO, not a jaxpr: a module holding float matmuls keeps them. The program exported
    from the int8ified function holds int8 dots only, and runs under int8ify unchanged."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((8, 256)).astype(np.float32), rng.standard_normal((256, 64)).astype(np.float32)
    float_program = jax.export.export(jax.jit(_dense))(x, w)

    with pytest.raises(Int8ifyError) as error:
        int8ify(pipeline, static_argnums=0)(float_program, x, w)
    assert re.search(r"primitive 'call_exported' at \S*test_hidden_matmuls\.py:\d+ \(pipeline\) calls a jax\.export'ed "
                     r"program \(Exported\.call\) whose module holds 1 float matmul\(s\) \(the first: "
                     r"tensor<8x256xf32> x tensor<256x64xf32>\), out of int8ify's reach \(JX105\); " + ADVICE,
                     str(error.value)), str(error.value)
    assert [f.code for f in verify(lambda x, w: pipeline(float_program, x, w), x, w)] == ["JX105"]
    int8_program = jax.export.export(jax.jit(int8ify(_dense)))(x, w)
    np.testing.assert_array_equal(np.asarray(int8ify(pipeline, static_argnums=0)(int8_program, x, w)),
                                  2 * np.asarray(int8_program.call(x, w)))
    assert verify(lambda x, w: pipeline(int8_program, x, w), x, w) == []

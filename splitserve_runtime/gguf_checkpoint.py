"""A GGUF file (llama.cpp's format) read as a Hugging Face checkpoint: config, tokenizer, tensors.

The `gguf` library reads the file. Its metadata maps onto a config.json (the keys transformers'
GGUF support maps for these families); transformers builds the tokenizer from the tokenizer
metadata (chat template included); tensors get their Hugging Face names and are dequantized with
`gguf.quants.dequantize` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, ...) to
float32 when read. llama.cpp's converter stores the q/k projection rows of Llama files permuted
for its rotary layout (Mistral files are "llama" too); reading undoes that.

Each tensor is dequantized only when a model reads it, so a rank touches only its own stage's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

# general.architecture -> (transformers model_type, architecture class name).
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# "<arch>.<key>" metadata -> config.json key (transformers' GGUF mapping for these families).
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "attention.key_length": "head_dim",  # where present, it wins over the rotary width
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
_TOKEN_IDS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "padding_token_id": "pad_token_id",
}
# llama.cpp's converter permutes the q/k rows of these architectures.
PERMUTED_ARCHITECTURES = ("llama",)
_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_BLOCK_MODULES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_tensor_name(name: str) -> str:
    """The Hugging Face name of GGUF tensor `name`; ValueError for a tensor with no place in a
    Llama-family model."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _BLOCK.match(name)
    if match and match.group(2) in _BLOCK_MODULES:
        layer, module, param = match.groups()
        return f"model.layers.{layer}.{_BLOCK_MODULES[module]}.{param}"
    raise ValueError(f"GGUF tensor {name!r} has no place in a Llama-family model")


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, rows (0, 2, 4, ..., 1, 3, 5, ...) back into
    the rotate-half order that Hugging Face checkpoints use."""
    half = rows.shape[0] // num_heads // 2
    grouped = rows.reshape(num_heads, half, 2, *rows.shape[1:])
    return grouped.swapaxes(1, 2).reshape(rows.shape)


class GgufTensor:
    """One tensor of the file as a `TensorSource`: dequantized to float32 on first read."""

    def __init__(self, tensor: Any, permute_heads: int | None = None) -> None:
        self.tensor = tensor
        self.permute_heads = permute_heads
        self._values: Any = None

    def get_shape(self) -> list[int]:
        return [int(n) for n in reversed(self.tensor.shape)]  # GGUF lists the fastest axis first

    def values(self) -> Any:
        """The whole tensor as a float32 torch tensor."""
        if self._values is None:
            import torch
            from gguf import quants

            array = quants.dequantize(self.tensor.data, self.tensor.tensor_type)
            array = np.ascontiguousarray(array, dtype=np.float32).reshape(self.get_shape())
            if self.permute_heads is not None:
                array = np.ascontiguousarray(unpermute_rows(array, self.permute_heads))
            if not array.flags.writeable:  # F32 tensors are views of the read-only mapped file
                array = array.copy()
            self._values = torch.from_numpy(array)
        return self._values

    def __getitem__(self, index: slice | tuple[slice, ...]) -> Any:
        return self.values()[index]


class GgufCheckpoint:
    """One open GGUF file: its architecture, configuration and tensors (read once)."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        self.reader = GGUFReader(str(path))
        self.architecture = str(self.field("general.architecture"))
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {self.architecture!r} ({self.path.name}) is not supported; "
                f"supported GGUF architectures: {', '.join(GGUF_ARCHITECTURES)}"
            )
        self.tensor_names = [t.name for t in self.reader.tensors]

    def field(self, key: str) -> Any:
        field = self.reader.fields.get(key)
        return None if field is None else field.contents()

    def hf_config_dict(self) -> dict[str, Any]:
        """config.json of the equivalent Hugging Face checkpoint (float32: the dequantized
        values are exact in it)."""
        if "rope_freqs.weight" in self.tensor_names:
            raise ValueError(
                f"{self.path.name} carries llama.cpp rope frequency factors (rope_freqs.weight, "
                "Llama 3.1 rope scaling), which splitserve does not read; serve the Hugging Face "
                "checkpoint instead"
            )
        arch = self.architecture
        model_type, architecture = GGUF_ARCHITECTURES[arch]
        config: dict[str, Any] = {"model_type": model_type, "architectures": [architecture]}
        for key, name in _CONFIG_KEYS.items():
            value = self.field(f"{arch}.{key}")
            if value is not None:
                config[name] = value
        embedding = next(t for t in self.reader.tensors if t.name == "token_embd.weight")
        config["vocab_size"] = int(embedding.shape[-1])
        config["tie_word_embeddings"] = "output.weight" not in self.tensor_names
        for key, name in _TOKEN_IDS.items():
            value = self.field(f"tokenizer.ggml.{key}")
            if value is not None:
                config[name] = int(value)
        rope_type = self.field(f"{arch}.rope.scaling.type")
        if rope_type not in (None, "none"):
            config["rope_scaling"] = {
                "rope_type": rope_type,
                "factor": float(self.field(f"{arch}.rope.scaling.factor") or 1.0),
            }
        config["dtype"] = "float32"
        return config

    def hf_config(self) -> Any:
        """transformers' configuration object for `hf_config_dict`."""
        from transformers import AutoConfig

        values = self.hf_config_dict()
        return AutoConfig.for_model(values.pop("model_type"), **values)

    def tensors(self) -> Iterator[tuple[str, GgufTensor]]:
        """Every tensor a model loads, as (Hugging Face name, lazily dequantized source)."""
        arch = self.architecture
        num_heads = self.field(f"{arch}.attention.head_count")
        num_kv_heads = self.field(f"{arch}.attention.head_count_kv") or num_heads
        is_permuted = arch in PERMUTED_ARCHITECTURES
        for tensor in self.reader.tensors:
            name = hf_tensor_name(tensor.name)
            heads = None
            if is_permuted and name.endswith("q_proj.weight"):
                heads = int(num_heads)
            elif is_permuted and name.endswith("k_proj.weight"):
                heads = int(num_kv_heads)
            yield name, GgufTensor(tensor, heads)


def load_gguf_tokenizer(path: str | Path) -> Any:
    """transformers' fast tokenizer built from the file's tokenizer metadata (chat template
    included). `PreTrainedTokenizerFast` reads only the tokenizer keys; AutoTokenizer would also
    rebuild the model configuration from the whole file (seconds more for the same tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    file = Path(path)
    return PreTrainedTokenizerFast.from_pretrained(
        str(file.parent), gguf_file=file.name, local_files_only=True
    )

"""The tiny model (`--model tiny`): a random-weight Llama checkpoint with its own tokenizer.

Fast tests and the Helm chart's embedded demo serve it. Nothing is downloaded: the tokenizer is a
byte-level BPE trained on a synthetic corpus drawn from a fixed word list with a fixed seed, and
the weights are drawn from a seeded generator, so every machine builds the same checkpoint. It is
built once, on first use, under splitserve's cache folder (`model_cache.default_cache_dir`), in
the folder `tiny-llama-v1`.

The weights are random: the model streams well-formed tokens, not sensible text.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping
from pathlib import Path

from splitserve_runtime.model_cache import default_cache_dir, ensure_built
from splitserve_runtime.model_spec import TINY_MODEL_DIRNAME

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)

# Llama-architecture shape of the tiny model (about 4 M parameters).
TINY_LLAMA_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "dtype": "float32",
}

_WORDS = """
the a an of to and in is it that for on with as was be by this are from at or not have
but they one all we can there which their more has will about if would so what when up out
them some time into other than then its only new these two may first any like also after
use how our work over such make even most well way much where through back good year long
model token engine request stream serve batch block cache prefix worker core frontend step
schedule kernel memory tensor layer attention head query key value rank pipeline parallel
sample greedy temperature logits prompt output text byte chunk queue latency throughput grpc
river mountain light window garden music paper water stone bright quiet early small large
city night morning story house friend people world number system program data state point
""".split()
_PUNCT = (".", ",", "?", "!", ":", ";")


def _corpus(num_lines: int, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.append(str(rng.randint(0, 9999)))
        yield " ".join(words) + rng.choice(_PUNCT)


def write_tokenizer(path: Path, vocab_size: int = 2048, seed: int = 0) -> None:
    """Train a byte-level BPE tokenizer on the synthetic corpus and save it in HF format. When
    the corpus supports fewer merges than `vocab_size`, `<|extra_N|>` tokens fill the rest."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bos, eos, pad = SPECIAL_TOKENS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(20000, seed), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def write_random_llama(
    path: Path, config: Mapping[str, object], vocab_size: int, seed: int, dtype: str = "float32"
) -> None:
    """Write config.json and model.safetensors of a random-weight Llama (plain torch, no
    modelling code), its tensors stored as `dtype`."""
    import torch
    from safetensors.torch import save_file

    cfg = dict(
        config, vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=2, dtype=dtype
    )
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])  # type: ignore[call-overload]
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])  # type: ignore[call-overload]
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    tensors = {"model.embed_tokens.weight": normal(vocab_size, hidden)}
    for i in range(int(cfg["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = normal(vocab_size, hidden)
    stored = {name: t.to(getattr(torch, dtype)) for name, t in tensors.items()}
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def build_tiny_model(path: Path, seed: int = 0) -> None:
    """Build the tiny checkpoint into `path` (created; must not exist)."""
    path.mkdir(parents=True)
    write_tokenizer(path, seed=seed)
    vocab_size = len(json.loads((path / "tokenizer.json").read_text())["model"]["vocab"])
    write_random_llama(path, TINY_LLAMA_CONFIG, vocab_size=vocab_size, seed=seed)


def ensure_tiny_model(environ: Mapping[str, str] | None = None) -> Path:
    """The tiny model's folder, built on first use."""
    target = default_cache_dir(environ) / TINY_MODEL_DIRNAME
    return ensure_built(target, "model.safetensors", build_tiny_model, "the tiny model")

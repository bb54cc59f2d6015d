"""One typed description of a decoder model, read from a HF config.json or GGUF metadata."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runlm.formats import ModelFormatError

# HF `architectures[0]` / `model_type` -> our family name.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DECODER_FAMILIES = frozenset(_HF_ARCHITECTURES.values())
# GGUF general.architecture values that are Llama-family decoders.
_GGUF_FAMILIES = {"llama": "llama", "mistral": "mistral", "smollm": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass(slots=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def num_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        arch = (cfg.get("architectures") or [None])[0]
        model_type = cfg.get("model_type")
        family = _HF_ARCHITECTURES.get(arch) or (model_type if model_type in DECODER_FAMILIES else None)
        if family is None:
            raise ModelFormatError(f"{source}: architecture {arch or cfg.get('model_type')!r} is not a supported "
                                   f"decoder (supported: {', '.join(sorted(_HF_ARCHITECTURES))})")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta")
        if isinstance(scaling, Mapping):
            theta = theta or scaling.get("rope_theta")
            if scaling.get("rope_type", scaling.get("type", "default")) == "default":
                scaling = None
        return cls(
            family=family, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta or 10000.0),
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", family == "mistral") else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])],
        )

    @classmethod
    def from_gguf(cls, gguf: Any) -> ModelConfig:
        arch = gguf.architecture
        family = _GGUF_FAMILIES.get(arch)
        if family is None:
            raise ModelFormatError(f"{gguf.path}: GGUF architecture {arch!r} is not a supported decoder")

        def get(key: str, default: Any = None) -> Any:
            return gguf.metadata.get(f"{arch}.{key}", default)

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        kv_heads = get("attention.head_count_kv", heads)
        tensors = gguf.tensors
        vocab = get("vocab_size") or len(gguf.metadata.get("tokenizer.ggml.tokens", [])) \
            or tensors["token_embd.weight"].shape[0]
        head_dim = int(get("attention.key_length") or hidden // heads)
        scaling = None
        stype = get("rope.scaling.type")
        if stype and stype != "none":
            scaling = {"rope_type": stype, "factor": float(get("rope.scaling.factor", 1.0))}
            if get("rope.scaling.original_context_length"):
                scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
        eos = gguf.metadata.get("tokenizer.ggml.eos_token_id")
        return cls(
            family=family, vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
            num_heads=heads, num_kv_heads=int(kv_heads if not isinstance(kv_heads, list) else kv_heads[0]),
            head_dim=head_dim, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            sliding_window=get("attention.sliding_window"),
            bos_token_id=gguf.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
        )

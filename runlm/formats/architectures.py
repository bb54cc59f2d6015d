"""Which architectures runlm builds, by format: decoders (they generate) and encoders (they embed or score
text). One list for the loader, which builds them, and the store, which labels a model's capabilities.
No torch here."""
from __future__ import annotations

# GGUF ``general.architecture`` values of encoder models
ENCODER_GGUF_ARCHS = frozenset({"bert", "nomic-bert", "jina-bert-v2", "xlm-roberta"})
# Hugging Face ``architectures`` entries of encoder models (the ...ForSequenceClassification ones score)
ENCODER_HF_ARCHS = frozenset({"BertModel", "BertForMaskedLM", "BertForSequenceClassification", "XLMRobertaModel",
                              "RobertaModel", "NomicBertModel"})

# Decoder families runlm generates with: HF ``architectures[0]`` -> family, GGUF ``general.architecture`` -> family.
DECODER_HF_ARCHS: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
DECODER_GGUF_ARCHS: dict[str, str] = {
    "llama": "llama", "mistral": "mistral", "smollm": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3",
    "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe",  # Mixtral's files say "llama"
}
# HF ``model_type`` values whose name differs from the family's
DECODER_HF_MODEL_TYPES: dict[str, str] = {"gemma3_text": "gemma3"}


def supported_decoders() -> str:
    """Every decoder architecture, for error messages: 'GGUF: gemma2, ...; Hugging Face: Gemma2ForCausalLM, ...'."""
    return (f"GGUF: {', '.join(sorted(DECODER_GGUF_ARCHS))}; "
            f"Hugging Face: {', '.join(sorted(DECODER_HF_ARCHS))}")

# llama.cpp stores Q/K of these architectures in the interleaved ("normal") RoPE layout.
_INTERLEAVED_ROPE_ARCHS = frozenset({"llama", "mistral", "smollm"})


def gguf_rope_interleaved(architecture: str) -> bool:
    """Whether a GGUF file of this ``general.architecture`` stores Q/K rows in llama.cpp's interleaved RoPE layout."""
    return architecture in _INTERLEAVED_ROPE_ARCHS

"""Which architectures runlm builds, by format: decoders (they generate) and encoders (they embed or score
text). One list for the loader, which builds them, and the store, which labels a model's capabilities.
No torch here.

A decoder family's names are its entry in ``DECODERS`` (the index its module under runlm.models.families is
found by: the store and this package tell capabilities without importing models); everything else the family
is (config mapping, torch model, what each runner builds) is that module's."""
from __future__ import annotations

from dataclasses import dataclass

# GGUF ``general.architecture`` values of encoder models
ENCODER_GGUF_ARCHS = frozenset({"bert", "nomic-bert", "jina-bert-v2", "xlm-roberta"})
# Hugging Face ``architectures`` entries of encoder models (the ...ForSequenceClassification ones score)
ENCODER_HF_ARCHS = frozenset({"BertModel", "BertForMaskedLM", "BertForSequenceClassification", "XLMRobertaModel",
                              "RobertaModel", "NomicBertModel"})


@dataclass(frozen=True, slots=True)
class DecoderNames:
    """How files name one decoder family."""
    hf: tuple[str, ...]                  # Hugging Face ``architectures[0]`` values
    gguf: tuple[str, ...] = ()           # GGUF ``general.architecture`` values
    model_types: tuple[str, ...] = ()    # HF ``model_type`` values besides the family's own name
    gguf_rope_interleaved: bool = False  # llama.cpp stores Q/K of its GGUF files in the interleaved RoPE layout


# family (the module runlm.models.families.<family>) -> its names
DECODERS: dict[str, DecoderNames] = {
    "llama": DecoderNames(("LlamaForCausalLM",), ("llama", "smollm"), gguf_rope_interleaved=True),
    "mistral": DecoderNames(("MistralForCausalLM",), ("mistral",), gguf_rope_interleaved=True),
    "qwen2": DecoderNames(("Qwen2ForCausalLM",), ("qwen2",)),
    "qwen3": DecoderNames(("Qwen3ForCausalLM",), ("qwen3",)),
    "gemma": DecoderNames(("GemmaForCausalLM",), ("gemma",)),
    "gemma2": DecoderNames(("Gemma2ForCausalLM",), ("gemma2",)),
    "gemma3": DecoderNames(("Gemma3ForCausalLM",), ("gemma3",), model_types=("gemma3_text",)),
    "phi3": DecoderNames(("Phi3ForCausalLM",), ("phi3",)),
    "mixtral": DecoderNames(("MixtralForCausalLM",)),  # Mixtral's GGUF files say "llama" (with experts)
    "qwen2_moe": DecoderNames(("Qwen2MoeForCausalLM",), ("qwen2moe",)),
    "qwen3_moe": DecoderNames(("Qwen3MoeForCausalLM",), ("qwen3moe",)),
    "olmoe": DecoderNames(("OlmoeForCausalLM",), ("olmoe",)),
    "olmo2": DecoderNames(("Olmo2ForCausalLM",), ("olmo2",)),
    "exaone4": DecoderNames(("Exaone4ForCausalLM",), ("exaone4",)),
    "hunyuan_dense": DecoderNames(("HunYuanDenseV1ForCausalLM",), ("hunyuan-dense",),
                                  model_types=("hunyuan_v1_dense",)),
    "arcee": DecoderNames(("ArceeForCausalLM",), ("arcee",), gguf_rope_interleaved=True),
    "seed_oss": DecoderNames(("SeedOssForCausalLM",), ("seed_oss",)),
    "smollm3": DecoderNames(("SmolLM3ForCausalLM",), ("smollm3",), gguf_rope_interleaved=True),
    "granite": DecoderNames(("GraniteForCausalLM",), ("granite",), gguf_rope_interleaved=True),
    "olmo3": DecoderNames(("Olmo3ForCausalLM",)),  # (llama.cpp writes its files as olmo2's)
    "ernie4_5": DecoderNames(("Ernie4_5ForCausalLM",), ("ernie4_5",), gguf_rope_interleaved=True),
    "stablelm": DecoderNames(("StableLmForCausalLM",), ("stablelm",)),
    "phi": DecoderNames(("PhiForCausalLM",), ("phi2",)),
    "starcoder2": DecoderNames(("Starcoder2ForCausalLM",), ("starcoder2",)),
    "cohere2": DecoderNames(("Cohere2ForCausalLM",), ("cohere2",), gguf_rope_interleaved=True),
    # (its GGUF Q/K keep RoPE's pairs too, but only a part of each head rotates: the model rotates pairs instead)
    "glm4": DecoderNames(("Glm4ForCausalLM",), ("glm4",)),
    "glm4_moe": DecoderNames(("Glm4MoeForCausalLM",), ("glm4moe",)),
    "dots1": DecoderNames(("Dots1ForCausalLM",), ("dots1",)),
    "ernie4_5_moe": DecoderNames(("Ernie4_5_MoeForCausalLM",), ("ernie4_5-moe",), gguf_rope_interleaved=True),
    "deepseek": DecoderNames(("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"), ("deepseek2",),
                             model_types=("deepseek_v2", "deepseek_v3")),
    "gpt_oss": DecoderNames(("GptOssForCausalLM",), ("gpt-oss",)),
    "llama4_text": DecoderNames(("Llama4ForCausalLM",), ("llama4",)),
    "apertus": DecoderNames(("ApertusForCausalLM",), ("apertus",)),
    "granitemoe": DecoderNames(("GraniteMoeForCausalLM",), ("granitemoe",), gguf_rope_interleaved=True),
    "granitemoehybrid": DecoderNames(("GraniteMoeHybridForCausalLM",), ("granitehybrid",), gguf_rope_interleaved=True),
    "bamba": DecoderNames(("BambaForCausalLM",)),  # (llama.cpp writes its files as granitehybrid's)
    "nemotron_h": DecoderNames(("NemotronHForCausalLM",), ("nemotron_h", "nemotron_h_moe")),
    "mamba2": DecoderNames(("Mamba2ForCausalLM",), ("mamba2",)),
    "lfm2": DecoderNames(("Lfm2ForCausalLM",), ("lfm2",)),
    "qwen3_next": DecoderNames(("Qwen3NextForCausalLM",), ("qwen3next",)),
    "falcon_h1": DecoderNames(("FalconH1ForCausalLM",), ("falcon-h1",)),
    "minimax": DecoderNames(("MiniMaxForCausalLM",)),
}

# Decoder families runlm generates with: HF ``architectures[0]`` -> family, GGUF ``general.architecture`` -> family.
DECODER_HF_ARCHS: dict[str, str] = {arch: family for family, names in DECODERS.items() for arch in names.hf}
DECODER_GGUF_ARCHS: dict[str, str] = {arch: family for family, names in DECODERS.items() for arch in names.gguf}
# HF ``model_type`` values whose name differs from the family's
DECODER_HF_MODEL_TYPES: dict[str, str] = {t: family for family, names in DECODERS.items() for t in names.model_types}


def supported_decoders() -> str:
    """Every decoder architecture, for error messages: 'GGUF: gemma2, ...; Hugging Face: Gemma2ForCausalLM, ...'."""
    return (f"GGUF: {', '.join(sorted(DECODER_GGUF_ARCHS))}; "
            f"Hugging Face: {', '.join(sorted(DECODER_HF_ARCHS))}")


def decoder_family(hf_arch: str | None = None, model_type: str | None = None) -> str | None:
    """The family of a Hugging Face config's ``architectures[0]`` or, failing that, its ``model_type``."""
    return (DECODER_HF_ARCHS.get(hf_arch or "") or DECODER_HF_MODEL_TYPES.get(model_type or "")
            or (model_type if model_type in DECODERS else None))


def gguf_rope_interleaved(architecture: str) -> bool:
    """Whether a GGUF file of this ``general.architecture`` stores Q/K rows in llama.cpp's interleaved RoPE layout."""
    family = DECODER_GGUF_ARCHS.get(architecture)
    return family is not None and DECODERS[family].gguf_rope_interleaved

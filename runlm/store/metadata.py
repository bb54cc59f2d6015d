"""What a model is, read once at pull time from its files' headers (no weights are loaded).

The runner uses it for ``show`` and for memory estimates, so it records the shapes that size
the KV cache as well as the user-facing facts.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runlm.formats import ModelFormatError
from runlm.formats.architectures import ENCODER_GGUF_ARCHS, ENCODER_HF_ARCHS
from runlm.formats.sampling_defaults import from_generation_config, from_gguf_metadata
from runlm.kv_size import kv_bytes_per_token, kv_cache_bytes_per_token

# GGUF types whose 2-D tensors runlm's engine keeps as int8 blocks in memory (about 1.25 bytes per weight)


@dataclass(slots=True)
class ModelInfo:
    format: str                      # "gguf" or "safetensors"
    architecture: str
    parameters: int
    quantization: str
    context_length: int
    template: str | None = None
    capabilities: list[str] = field(default_factory=lambda: ["completion"])
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    value_dim: int | None = None     # V's width per KV head where it is not head_dim (latent attention's cache: 0)
    # for memory estimates: the matrices the native engine computes on as stored (2-D, any type but
    # F32; they stay in the mapped file), their parameter count, and whether the output layer reuses
    # the token embeddings
    stored_matrix_bytes: int = 0
    stored_matrix_params: int = 0
    tied_embeddings: bool = False
    # mixtures of experts: experts per MoE layer and how many each token uses (0: a dense model)
    experts: int = 0
    experts_used: int = 0
    # diffusers pipelines (format "diffusers"; architecture is the pipeline class): component -> "library.Class"
    components: dict[str, str] = field(default_factory=dict)
    # the sampling settings the model recommends (SamplingParams field -> value): its own files' (GGUF
    # general.sampling.*, generation_config.json) over the built-in catalogue's; what a request leaves out
    sampling: dict[str, float | int] = field(default_factory=dict)

    @property
    def parameter_size(self) -> str:
        """Ollama's short form: 135M, 1.5B."""
        n = self.parameters
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"

    def kv_bytes_per_token(self, bytes_per_value: int = 4) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, bytes_per_value, self.value_dim)

    def kv_cache_bytes_per_token(self, kv_cache_dtype: str = "auto") -> int:
        """The CPU engine's KV bytes per token for --kv-cache-dtype (auto: fp32; a model whose head_dim q8_0 cannot
        hold counts as fp32: its engine refuses to start, and says why)."""
        if kv_cache_dtype == "q8_0" and self.head_dim % 32:
            kv_cache_dtype = "auto"
        return kv_cache_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, kv_cache_dtype,
                                        v_dim=self.value_dim)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelInfo:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def kv_layer_count(cfg: dict[str, Any]) -> int:
    """The layers of a HF config that keep K/V: ModelConfig.kv_layers for a decoder runlm builds (a hybrid's
    attention layers alone; Mamba2 none), every layer of anything else."""
    from runlm.models.config import ModelConfig

    try:
        return len(ModelConfig.from_hf(cfg).kv_layers)
    except (ModelFormatError, KeyError, TypeError, ValueError):
        return int(cfg.get("num_hidden_layers", 0))


def inspect_gguf(path: Path) -> ModelInfo:
    import gguf

    from runlm.formats.gguf_header import read_model

    try:
        _, metadata, index = read_model(path)  # (every file of a split model)
    except (ValueError, IndexError, KeyError) as exc:
        raise ModelFormatError(f"{path.name}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    tensors = list(index.values())

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(key, default)

    arch = str(get("general.architecture", "unknown"))
    if arch == "clip":  # (runlm.store.mmproj.PROJECTOR_ARCHITECTURE)
        raise ModelFormatError(f"{path.name}: a multimodal projector (mmproj), not a model: pull the text GGUF it "
                               f"belongs to, with the projector beside it or given as --mmproj")
    ftype = get("general.file_type")
    try:
        quant = gguf.LlamaFileType(ftype).name.removeprefix("MOSTLY_") if ftype is not None else None
    except ValueError:
        quant = None
    if quant is None:  # the most common tensor type names the file
        types = [t.qtype for t in tensors]
        quant = max(set(types), key=types.count) if types else "unknown"
    heads = int(get(f"{arch}.attention.head_count", 1) or 1)
    kv_heads = get(f"{arch}.attention.head_count_kv", heads)
    layers = int(get(f"{arch}.block_count", 0) or 0)
    if isinstance(kv_heads, list):  # per layer (0: a layer without K/V, a hybrid's Mamba2 or MLP layer)
        layers, kv_heads = sum(1 for k in kv_heads if k), max(kv_heads, default=0)
    elif get(f"{arch}.attention.head_count") == 0:  # no attention at all (Mamba2)
        layers = 0
    recurrent = get(f"{arch}.attention.recurrent_layers")  # (Qwen3-Next's DeltaNet layers keep no K/V)
    if isinstance(recurrent, list):
        layers = sum(1 for r in recurrent if not r)
    kv_heads = int(kv_heads)
    hidden = int(get(f"{arch}.embedding_length", 0) or 0)
    # 2-D matrices and stacked 3-D expert tensors (each expert a matrix), all experts counted
    stored = [t for t in tensors if t.qtype != "F32" and len(t.shape) in (2, 3)]
    return ModelInfo(
        format="gguf", architecture=arch,
        parameters=sum(t.n_values for t in tensors),
        quantization=quant, context_length=int(get(f"{arch}.context_length", 2048)),
        template=get("tokenizer.chat_template"),
        capabilities=["embedding"] if arch in ENCODER_GGUF_ARCHS else ["completion"],
        num_layers=layers, num_kv_heads=kv_heads,
        # (llama.cpp writes latent attention as one KV head whose K is the latent and whose V is a part of it)
        head_dim=int(get(f"{arch}.attention.key_length", 0) or (hidden // heads if hidden else 0)),
        value_dim=0 if get(f"{arch}.attention.kv_lora_rank") else None,
        stored_matrix_bytes=sum(int(t.n_bytes) for t in stored),
        stored_matrix_params=sum(t.n_values for t in stored),
        tied_embeddings="output.weight" not in index,
        experts=int(get(f"{arch}.expert_count", 0) or 0), experts_used=int(get(f"{arch}.expert_used_count", 0) or 0),
        sampling=from_gguf_metadata(metadata))


MAX_SAFETENSORS_HEADER = 100 << 20


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The header of a safetensors file, every length and offset in it checked against the file's size.
    Errors name the field at fault, never a value read from the file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ModelFormatError(f"{path.name}: too short for a safetensors header ({size} bytes)")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, MAX_SAFETENSORS_HEADER):
            raise ModelFormatError(f"{path.name}: the safetensors header length runs past the end of the file "
                                   f"({size} bytes) or past {MAX_SAFETENSORS_HEADER} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ModelFormatError(f"{path.name}: the safetensors header is not UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path.name}: the safetensors header is not a JSON object")
    data_size = size - 8 - n
    for name, t in header.items():
        if name == "__metadata__":
            if not isinstance(t, dict):
                raise ModelFormatError(f"{path.name}: the safetensors __metadata__ is not a JSON object")
            continue
        _check_tensor_entry(path, name, t, data_size)
    return header


def _check_tensor_entry(path: Path, name: str, t: Any, data_size: int) -> None:
    where = f"{path.name}: tensor {name[:200]!r}"
    if not isinstance(t, dict) or not isinstance(t.get("dtype"), str):
        raise ModelFormatError(f"{where}: the safetensors entry has no dtype")
    shape, offsets = t.get("shape"), t.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > 8 or \
            not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= data_size for d in shape):
        raise ModelFormatError(f"{where}: the safetensors shape is not a list of at most 8 sizes that fit the file")
    if not isinstance(offsets, list) or len(offsets) != 2 or \
            not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets) or \
            not 0 <= offsets[0] <= offsets[1] <= data_size:
        raise ModelFormatError(f"{where}: the safetensors data_offsets run outside the file's data")
    n_values = math.prod(shape)
    if n_values > 0 and offsets[1] - offsets[0] < n_values // 8:  # no dtype is smaller than a bit
        raise ModelFormatError(f"{where}: the safetensors shape needs more bytes than its data_offsets give")


def count_parameters(files: list[Path]) -> tuple[int, dict[str, int]]:
    """Parameters in safetensors files, from their headers: the total and how many of each dtype."""
    params, dtypes = 0, dict[str, int]()
    for f in files:
        for name, t in _safetensors_header(f).items():
            if name != "__metadata__":
                n = math.prod(t["shape"])
                params += n
                dtypes[t["dtype"]] = dtypes.get(t["dtype"], 0) + n
    return params, dtypes


MAX_SIDE_FILE = 64 << 20  # config.json, tokenizer_config.json, chat_template.jinja: real ones are far smaller


def _read_capped(path: Path) -> str:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size > MAX_SIDE_FILE:
            raise ModelFormatError(f"{path.name}: larger than the {MAX_SIDE_FILE} bytes runlm reads from such a file")
        return f.read(MAX_SIDE_FILE).decode("utf-8")


def vision_text_config(cfg: dict) -> dict | None:
    """The text decoder's config of a vision-language model runlm serves (its model_type is a vision family's:
    runlm.models.vision.hf_family), or None for any other model. Only a vision family's configs import the
    family (it brings torch)."""
    from runlm.models.vision import hf_family, is_vision_config

    if not is_vision_config(cfg):
        return None
    try:
        family = hf_family(cfg)
        text = family.text_config(cfg) if family is not None else None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return text if isinstance(text, dict) else None


def inspect_safetensors_dir(directory: Path) -> ModelInfo:
    try:
        cfg = json.loads(_read_capped(directory / "config.json"))
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError, a file too large
        raise ModelFormatError(f"{directory.name}: no readable config.json ({type(exc).__name__})") from None
    if not isinstance(cfg, dict):
        raise ModelFormatError(f"{directory.name}: config.json is not a JSON object")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{directory.name}: no *.safetensors weights next to config.json")
    params, dtypes = count_parameters(files)
    arch = (cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0]
    caps = ["completion"]
    text_cfg = vision_text_config(cfg)
    if text_cfg is not None:  # a vision-language model: the decoder's shapes size the KV cache
        caps = ["completion", "vision"]
        cfg = {**cfg, **text_cfg}
    elif arch.endswith("ForSequenceClassification"):
        caps = ["reranking"]
    elif arch in ENCODER_HF_ARCHS or (directory / "modules.json").exists() and "CausalLM" not in arch:
        caps = ["embedding"]
    template = None
    if (directory / "chat_template.jinja").exists():
        template = _read_capped(directory / "chat_template.jinja")
    elif (directory / "tokenizer_config.json").exists():
        tok_cfg = json.loads(_read_capped(directory / "tokenizer_config.json"))
        template = tok_cfg.get("chat_template") if isinstance(tok_cfg, dict) else None
    heads = int(cfg.get("num_attention_heads", 1))
    hidden = int(cfg.get("hidden_size", 0))
    return ModelInfo(
        format="safetensors", architecture=arch, parameters=params,
        quantization=max(dtypes, key=lambda d: dtypes[d]) if dtypes else "unknown",
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        template=template if isinstance(template, str) else None, capabilities=caps,
        num_layers=kv_layer_count(cfg),
        # (latent attention: one latent row per token, no V)
        num_kv_heads=1 if cfg.get("kv_lora_rank") else int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0) if cfg.get("kv_lora_rank")
        else int(cfg.get("head_dim") or (hidden // heads if hidden else 0)),
        value_dim=0 if cfg.get("kv_lora_rank") else None,
        experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
        experts_used=int(cfg.get("num_experts_per_tok") or 0) if cfg.get("num_local_experts") or cfg.get("num_experts")
        else 0, sampling=from_generation_config(directory))

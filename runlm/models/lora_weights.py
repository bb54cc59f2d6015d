"""Read a LoRA adapter into one form: per Hugging Face module name, A [r, in] and B [out, r] in fp32 with
the adapter's scale folded into B, Q/K rows in the rotate-half layout of HF checkpoints.

Two formats:

* PEFT directories: ``adapter_config.json`` (r, lora_alpha, use_rslora, rank_pattern, alpha_pattern)
  and ``adapter_model.safetensors`` (or ``.bin``) holding ``...<module>.lora_A.weight`` / ``lora_B``.
* GGUF LoRA files as llama.cpp's ``convert_lora_to_gguf.py`` writes them: ``general.type`` "adapter",
  ``adapter.lora.alpha``, tensors ``blk.N.<name>.weight.lora_a`` [r, in] and ``.lora_b`` [out, r],
  with the B rows of Q and K permuted into llama.cpp's interleaved RoPE layout (undone here).

Anything this cannot apply exactly (DoRA, trained biases, embedding or whole-module replacements,
Conv1D layouts) is refused with an error naming the adapter and the module.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from runlm.formats import LoRAError, ModelFormatError
from runlm.formats.architectures import gguf_rope_interleaved
from runlm.formats.gguf import GGUFFile
from runlm.models.config import ModelConfig
from runlm.models.weights import _unpermute, hf_name_for_gguf

__all__ = ["LoRAError", "LoRAModule", "LoRAWeights", "read_adapter"]


@dataclass(slots=True)
class LoRAModule:
    a: torch.Tensor  # fp32 [r, in]
    b: torch.Tensor  # fp32 [out, r], times the adapter's scale

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(slots=True)
class LoRAWeights:
    modules: dict[str, LoRAModule]  # HF module name ('model.layers.0.self_attn.q_proj') -> its update
    source: str

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def read_adapter(path: str | Path, cfg: ModelConfig) -> LoRAWeights:
    """A PEFT directory or a GGUF LoRA file -> LoRAWeights (head counts from the base model's ``cfg``)."""
    path = Path(path)
    if path.is_dir():
        weights = _read_peft(path)
    elif path.is_file():
        weights = _read_gguf(path, cfg)
    else:
        raise LoRAError(f"LoRA adapter {str(path)!r} does not exist (a PEFT directory or a GGUF LoRA file)")
    if not weights.modules:
        raise LoRAError(f"LoRA adapter {str(path)!r} holds no LoRA weights")
    return weights


# ---- PEFT ------------------------------------------------------------------------------------

def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: a key matches a module name ending in it (a regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return default


def _peft_config(path: Path) -> dict:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise LoRAError(f"{path}: not a PEFT adapter (no adapter_config.json)") from None
    except json.JSONDecodeError as e:
        raise LoRAError(f"{path}/adapter_config.json is not valid JSON: {e}") from None
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise LoRAError(f"{path}: peft_type {kind!r} is not LoRA")
    for key, why in (("use_dora", "DoRA adapters"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) layouts")):
        if config.get(key):
            raise LoRAError(f"{path}: {why} are not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{path}: adapters that train biases (bias={config['bias']!r}) are not supported")
    return config


def _peft_tensors(path: Path) -> dict[str, torch.Tensor]:
    st, binary = path / "adapter_model.safetensors", path / "adapter_model.bin"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(st)
    if binary.is_file():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise LoRAError(f"{path}: no adapter_model.safetensors (or adapter_model.bin)")


def _read_peft(path: Path) -> LoRAWeights:
    config = _peft_config(path)
    r, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora"))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _peft_tensors(path).items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight", key)
        if m is None:
            module = re.sub(r"\.(lora_\w+|weight|bias|base_layer).*$", "", key.removeprefix("base_model.model."))
            raise LoRAError(f"{path}: tensor {key!r} (module {module!r}) is not a LoRA A/B matrix; "
                            f"embedding adapters, DoRA and modules_to_save are not supported")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    modules = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{path}: module {module!r} has lora_{next(iter(ab))} but not its pair")
        a, b = ab["A"].float(), ab["B"].float()
        rank = int(_pattern_value(config.get("rank_pattern") or {}, module, r))
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] != rank:
            raise LoRAError(f"{path}: module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                            f"are not a rank-{rank} pair")
        mod_alpha = _pattern_value(config.get("alpha_pattern") or {}, module, alpha)
        scale = mod_alpha / (math.sqrt(rank) if rslora else rank)
        modules[module] = LoRAModule(a.contiguous(), (b * scale).contiguous())
    return LoRAWeights(modules, str(path))


# ---- GGUF ------------------------------------------------------------------------------------

def _read_gguf(path: Path, cfg: ModelConfig) -> LoRAWeights:
    try:
        gguf = GGUFFile(path)
    except ModelFormatError as e:
        raise LoRAError(str(e)) from None
    if gguf.metadata.get("general.type") != "adapter" or gguf.metadata.get("adapter.type") != "lora":
        raise LoRAError(f"{path}: not a GGUF LoRA adapter (general.type {gguf.metadata.get('general.type')!r}, "
                        f"adapter.type {gguf.metadata.get('adapter.type')!r})")
    alpha = gguf.metadata.get("adapter.lora.alpha") or 0.0
    if not isinstance(alpha, (int, float)):
        raise LoRAError(f"{path}: adapter.lora.alpha is {alpha!r}, not a number")
    pairs: dict[str, dict[str, str]] = {}
    for name in gguf.tensors:
        m = re.fullmatch(r"(.+)\.lora_([ab])", name)
        if m is None:
            raise LoRAError(f"{path}: tensor {name!r} is not a LoRA a/b matrix (only LoRA matrices can be applied)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = name
    permuted = gguf_rope_interleaved(gguf.architecture)
    modules = {}
    for base, ab in pairs.items():
        hf = hf_name_for_gguf(base, gguf.architecture)
        if hf is None or not hf.endswith(".weight"):
            raise LoRAError(f"{path}: LoRA on {base!r}, which is not a {gguf.architecture} decoder matrix")
        module = hf.removesuffix(".weight")
        if set(ab) != {"a", "b"}:
            raise LoRAError(f"{path}: module {module!r} has lora_{next(iter(ab))} but not its pair")
        a, b = gguf.load(ab["a"]), gguf.load(ab["b"])
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(f"{path}: module {module!r}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} "
                            f"are not a low-rank pair")
        heads = cfg.num_heads if module.endswith(".q_proj") else cfg.num_kv_heads if module.endswith(".k_proj") else 0
        if permuted and heads:
            b = _unpermute(b, heads)
        # llama.cpp's scale: alpha / rank, or 1 when the file gives no alpha
        scale = alpha / a.shape[0] if alpha else 1.0
        modules[module] = LoRAModule(a.contiguous(), (b * scale).contiguous())
    return LoRAWeights(modules, str(path))

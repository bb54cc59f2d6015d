"""Weights straight to the device, for the GPU runner (runlm.engine.runners.gpu).

- safetensors: the model is built on "meta"; each tensor is read onto the device in its stored dtype (bf16/fp16)
  and only there converted to the compute dtype, so no fp32 copy is ever made on the host. Q/K/V and gate/up
  are stacked on the device (the model's fused parameters, as ``load_weights`` stacks them).
- GGUF: each matrix is uploaded as stored (its ggml blocks) and dequantized on the device by the torch
  implementations below (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, and F32/F16/BF16; a rarer type is dequantized on the host
  by the GGUF reader and uploaded), then Q/K are permuted back to the rotate-half layout. A log line states the
  memory cost: the blocks' size on disk against the dense weights the device then holds.

Before anything is read, a model whose weights alone exceed gpu_memory_utilization x the device's memory is
refused, with both sizes named. The tensors equal ``runlm.models.load.load_decoder``'s (tests compare them).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from math import prod
from pathlib import Path
from typing import cast

import torch
from torch import nn

from runlm.dtypes import torch_dtype
from runlm.formats import ModelFormatError
from runlm.formats.architectures import gguf_rope_interleaved
from runlm.formats.gguf import GGUFFile
from runlm.models.config import ModelConfig
from runlm.models.llama import LlamaForCausalLM, stacked_target
from runlm.models.load import LoadedModel, _empty_model
from runlm.models.spec import ModelSpec, as_spec

log = logging.getLogger("runlm.gpu")

# ---- GGUF blocks dequantized by torch, on whatever device holds them ------------------------------------------
def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from a [..., 2] uint8 tensor, as float32."""
    return raw.contiguous().view(torch.float16).float().squeeze(-1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = b[:, 2:].contiguous().view(torch.int8).float()
    return d[:, None] * q


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    qs = b[:, 2:].to(torch.int16)
    q = torch.cat([qs & 0xF, qs >> 4], dim=1).float() - 8.0
    return d[:, None] * q


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> [blocks, 8] each (ggml's get_scale_min_k4)."""
    s = scales.to(torch.int16)
    sc_lo, m_lo = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc_hi = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    m_hi = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([sc_lo, sc_hi], 1).float(), torch.cat([m_lo, m_hi], 1).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    qs = b[:, 16:144].to(torch.int16).view(-1, 4, 32)  # 4 chunks of 32 bytes: 64 values each
    q = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32).float()  # sub-block j: 32 values
    return (d[:, None, None] * sc[:, :, None] * q - dmin[:, None, None] * m[:, :, None]).reshape(-1, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].to(torch.int16)
    qs = b[:, 48:176].to(torch.int16).view(-1, 4, 32)
    low = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32)
    high = torch.stack([(qh >> j) & 1 for j in range(8)], dim=1)  # sub-block j takes bit j of qh
    q = (low | (high << 4)).float()
    return (d[:, None, None] * sc[:, :, None] * q - dmin[:, None, None] * m[:, :, None]).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, 0:128].to(torch.int16).view(-1, 2, 64)
    qh = b[:, 128:192].to(torch.int16).view(-1, 2, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().view(-1, 2, 8)
    d = _f16(b[:, 208:210])
    lo0, lo1 = ql[:, :, :32], ql[:, :, 32:]
    q = torch.stack([(lo0 & 0xF) | ((qh & 3) << 4), (lo1 & 0xF) | (((qh >> 2) & 3) << 4),
                     (lo0 >> 4) | (((qh >> 4) & 3) << 4), (lo1 >> 4) | (((qh >> 6) & 3) << 4)], dim=2)
    q = q.float().view(-1, 2, 4, 2, 16) - 32.0  # half, quarter, 16-value group (scale index 2 * quarter + group)
    scale = sc.view(-1, 2, 4, 2)[..., None]
    return (d[:, None, None, None, None] * scale * q).reshape(-1, 256)


# qtype -> (values per block, bytes per block, dequantizer)
DEVICE_QUANTS: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q8_0": (32, 34, _q8_0), "Q4_0": (32, 18, _q4_0), "Q4_K": (256, 144, _q4_k), "Q5_K": (256, 176, _q5_k),
    "Q6_K": (256, 210, _q6_k),
}


def dequantize_on_device(raw: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """ggml bytes (uint8, on any device) of type ``qtype`` -> float32 of ``shape`` on the same device."""
    flat = raw.reshape(-1)
    if qtype == "F32":
        return flat.view(torch.float32).reshape(shape).clone()
    if qtype in ("F16", "BF16"):
        return flat.view(torch.float16 if qtype == "F16" else torch.bfloat16).float().reshape(shape)
    per_block, nbytes, fn = DEVICE_QUANTS[qtype]
    return fn(flat.view(-1, nbytes)).reshape(shape)


# ---- loading ---------------------------------------------------------------------------------------------------
def check_fits(weight_bytes: int, device: torch.device, gpu_memory_utilization: float, what: str) -> None:
    """Refuse a model whose weights alone exceed the device's share, naming both sizes."""
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    share = int(gpu_memory_utilization * total)
    if weight_bytes > share:
        raise ValueError(f"{what}: its weights need {weight_bytes / 2**30:.2f} GiB on the GPU, but "
                         f"gpu_memory_utilization {gpu_memory_utilization} of the device's {total / 2**30:.2f} GiB "
                         f"is {share / 2**30:.2f} GiB")


def _safetensors_tensors(directory: Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{directory}: no *.safetensors weights")
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)  # the stored dtype, on the device
        except (SafetensorError, OSError) as exc:
            raise ModelFormatError(f"{file}: cannot read safetensors ({exc})") from None


def _gguf_tensors(gguf: GGUFFile, cfg: ModelConfig, device: torch.device, stats: list[int]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named float32 tensors dequantized on the device (runlm.models.weights.gguf_weights' reading of the file,
    every family's renaming and conversion included); stats gets [stored bytes, dense fp32 bytes]."""
    from runlm.models.weights import gguf_weights

    def load(name: str) -> torch.Tensor:
        info = gguf.tensors[name]
        if info.qtype in DEVICE_QUANTS or info.qtype in ("F32", "F16", "BF16"):
            tensor = dequantize_on_device(gguf.raw_tensor(name).to(device), info.qtype, info.shape)
        else:  # a rarer block type: the host's dequantizer, then the device
            tensor = gguf.load(name).to(device)
        stats[0] += info.n_bytes
        stats[1] += tensor.numel() * 4
        return tensor

    for name, tensor in gguf_weights(gguf, cfg, "dense", load):
        yield name, cast(torch.Tensor, tensor).to(device)  # (metadata-derived weights are made on the host)


def fill_parameters(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """Every parameter of a model built on "meta" from HF-named tensors already on the device, converted to
    ``dtype`` there; Q/K/V and gate/up stacked."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    tied = getattr(model, "lm_head", None) is None
    if isinstance(model, LlamaForCausalLM):  # (a family's own reading of its checkpoint: Gemma's norms)
        weights = cast(Iterator[tuple[str, torch.Tensor]], iter(model.checkpoint_weights(weights)))
    params = dict(model.named_parameters())
    for name, tensor in weights:
        if "rotary_emb" in name or (name == "lm_head.weight" and tied):
            continue
        target, shard = stacked_target(name, params)
        shards.setdefault(target, {})[shard] = tensor.to(dtype)
    unexpected = [n for n in shards if n not in params]
    if unexpected:
        raise KeyError(f"unexpected weight {unexpected[0]!r}")
    missing = [n for n in params if n not in shards]
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    for name, parts in shards.items():
        tensor = parts[-1] if -1 in parts else torch.cat([parts[i] for i in sorted(parts)])
        module_name, attr = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        shape = getattr(module, attr).shape
        if tensor.numel() != shape.numel():
            raise RuntimeError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not fit {tuple(shape)}")
        setattr(module, attr, nn.Parameter(tensor.reshape(shape).contiguous(), requires_grad=False))


def load_to_device(model: ModelSpec | str | Path, dtype: torch.dtype | str = "bfloat16", device: str = "cuda",
                   gpu_memory_utilization: float = 0.9, mmproj: str | Path | None = None) -> LoadedModel:
    """A Llama-family decoder from a .gguf file or a safetensors directory (a ModelSpec, or its path), its weights
    on ``device`` in ``dtype`` (see the module docstring)."""
    from runlm.models import families
    from runlm.models import vision as vlm
    from runlm.models.load import split_vision
    from runlm.models.weights import hf_renamed, rope_freq_factors

    spec = as_spec(model, mmproj)
    dtype, dev, path = torch_dtype(dtype), torch.device(device), spec.path
    itemsize = torch.empty(0, dtype=dtype).element_size()
    cfg = spec.decoder_config()
    tokenizer = spec.tokenizer()
    stats = [0, 0]
    vision_weights: list[tuple[str, torch.Tensor]] = []
    family = vlm.family_module(spec.vision) if spec.vision is not None and spec.projector is None else None
    if spec.gguf is not None:
        gguf = spec.gguf
        check_fits(sum(i.n_values for n, i in gguf.tensors.items()) * itemsize, dev, gpu_memory_utilization,
                   path.name)
        model_ = _empty_model(cfg, rope_freq_factors(gguf))
        weights = _gguf_tensors(gguf, cfg, dev, stats)
    else:
        values = sum(prod(t.shape) for t in spec.safetensors().tensors.values())
        check_fits(values * itemsize, dev, gpu_memory_utilization, path.name)
        model_ = _empty_model(cfg)
        weights = _safetensors_tensors(path, dev)
        if family is not None:  # a vision-language directory: the tower's tensors set aside as it goes
            weights = cast(Iterator[tuple[str, torch.Tensor]],
                           split_vision(weights, family.text_weight, vision_weights))
        weights = hf_renamed(weights, cfg.family)
    # GLM-4, ERNIE, Cohere: Q/K rows in rotated pairs (a GGUF whose converter permuted them is read turned back)
    turned = spec.gguf is not None and gguf_rope_interleaved(spec.gguf.architecture)
    if families.get(cfg.family).hf_rope_interleaved and not turned:
        model_.model.rope.use_interleaved_pairs()
    try:
        with torch.no_grad():
            fill_parameters(model_, weights, dtype)
    except (KeyError, RuntimeError) as exc:
        raise ModelFormatError(f"{path}: weights do not fit the {cfg.family} config: {exc}") from None
    if stats[0]:
        dense = sum(p.numel() * p.element_size() for p in model_.parameters())
        log.info("%s: GGUF blocks (%.1f MiB as stored) dequantized on %s to %s: the weights take %.1f MiB there "
                 "(%.1fx)", path.name, stats[0] / 2**20, dev, str(dtype).removeprefix("torch."), dense / 2**20,
                 dense / stats[0])
    model_ = model_.to(device=dev, dtype=dtype).eval()
    model_.model.fused = False
    vision = None
    if family is not None:
        assert spec.hf_config is not None
        vision = vlm.build_hf(path, spec.hf_config, [(n, t.float().cpu()) for n, t in vision_weights], tokenizer)
    elif spec.projector is not None:
        vision = vlm.build_mmproj(spec.projector, tokenizer)
    if vision is not None:  # the tower on the device in float32 (its numerics: transformers'), its rows cast
        vision = vision.to(device=dev)  # to the model's dtype as they are written over the placeholders
    return LoadedModel(model_, cfg, tokenizer, path, vision)

"""Weights straight to the device, for the GPU runner (runlm.engine.runners.gpu).

- safetensors: the model is built on "meta"; each tensor is read onto the device in its stored dtype (bf16/fp16)
  and only there converted to the compute dtype, so no fp32 copy is ever made on the host. Q/K/V and gate/up
  are stacked on the device (the model's fused parameters, as ``load_weights`` stacks them). A pre-quantized
  checkpoint's matrices (GPTQ/AWQ 4-bit, FP8) stay as stored, repacked on the device for the Triton kernel that
  dequantizes them in registers (runlm.models.gpu_prequantized).
- GGUF: each matrix is uploaded as stored (its ggml blocks) and dequantized on the device by the torch
  implementations below (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, and F32/F16/BF16; a rarer type is dequantized on the host
  by the GGUF reader and uploaded), then Q/K are permuted back to the rotate-half layout. A log line states the
  memory cost: the blocks' size on disk against the dense weights the device then holds.

Before anything is read, a model whose weights alone exceed gpu_memory_utilization x the device's memory is
refused, with both sizes named. The tensors equal ``runlm.models.load.load_decoder``'s (tests compare them).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import torch
from torch import nn

from runlm.dtypes import torch_dtype
from runlm.formats import ModelFormatError
from runlm.formats.architectures import gguf_rope_interleaved
from runlm.formats.gguf import GGUFFile
from runlm.models.config import ModelConfig
from runlm.models.gpu_blocks import DEVICE_QUANTS, KEPT_TYPES, blocks_linear, dense, dense_rows, dequantize_on_device
from runlm.models.gpu_moe import stack_model_experts
from runlm.models.gpu_prequantized import DeviceQuantized, device_prequantized
from runlm.models.linear import Embedding, GGMLWeight, Linear, Weight
from runlm.models.llama import LlamaForCausalLM, stacked_target
from runlm.models.load import LoadedModel, _empty_model
from runlm.models.offload import HOST, HOST_DTYPE, LayerSplit, offload_layers, weight_bytes_on_device
from runlm.models.spec import ModelSpec, as_spec

log = logging.getLogger("runlm.gpu")

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


def _gguf_tensors(gguf: GGUFFile, cfg: ModelConfig, device: torch.device, stats: list[int], blocks: bool,
                  split: LayerSplit | None = None) -> Iterator[tuple[str, Weight]]:
    """HF-named weights on the device (runlm.models.weights.gguf_weights' reading of the file, every family's
    renaming and conversion included): with ``blocks``, matrices of a type the GPU kernel reads as GGMLWeight
    (their bytes uploaded as stored), the rest float32 dequantized on the device; stats gets [stored bytes, bytes
    on the device as float32 or blocks]. A ``split``'s CPU layers stay on the host (their blocks as mapped)."""
    from runlm.models.weights import gguf_weights

    def load(name: str) -> torch.Tensor:
        info = gguf.tensors[name]
        on = HOST if split is not None and split.on_host(name) else device
        if info.qtype in DEVICE_QUANTS or info.qtype in ("F32", "F16", "BF16"):
            tensor = dequantize_on_device(gguf.raw_tensor(name).to(on), info.qtype, info.shape)
        else:  # a rarer block type: the host's dequantizer, then the device
            tensor = gguf.load(name).to(on)
        if on == device:
            stats[0] += info.n_bytes
            stats[1] += tensor.numel() * 4
        return tensor

    for name, weight in gguf_weights(gguf, cfg, "blocks" if blocks else "dense", load,
                                     KEPT_TYPES if blocks else frozenset()):
        if split is not None and split.on_host(name):
            yield name, weight
        elif isinstance(weight, GGMLWeight):
            stats[0] += weight.raw.numel()
            stats[1] += weight.raw.numel()
            yield name, GGMLWeight(weight.raw.to(device), weight.qtype, weight.rows, weight.cols)
        else:  # (metadata-derived weights are made on the host)
            yield name, cast(torch.Tensor, weight).to(device)


def fill_parameters(model: nn.Module, weights: Iterator[tuple[str, Weight]], dtype: torch.dtype,
                    split: LayerSplit | None = None) -> None:
    """Every parameter of a model built on "meta" from HF-named tensors already on the device, converted to
    ``dtype`` there; Q/K/V and gate/up stacked. A linear layer whose every part comes in GGUF blocks keeps them
    (Linear.keep_device_blocks); blocks meant for anything else are dequantized. A ``split``'s CPU layers are
    float32, their GGUF blocks multiplied by the CPU kernels (Linear.keep_ggml)."""
    def dtype_of(name: str) -> torch.dtype:
        return HOST_DTYPE if split is not None and split.on_host(name) else dtype

    shards: dict[str, dict[int, torch.Tensor | GGMLWeight | DeviceQuantized]] = {}
    tied = getattr(model, "lm_head", None) is None
    if isinstance(model, LlamaForCausalLM):  # (a family's own reading of its checkpoint; no MTP layers)
        weights = cast(Iterator[tuple[str, Weight]], model.decoder_weights(weights))
    params = dict(model.named_parameters())
    for name, tensor in weights:
        if "rotary_emb" in name or (name == "lm_head.weight" and tied):
            continue
        target, shard = stacked_target(name, params)
        shards.setdefault(target, {})[shard] = tensor if isinstance(tensor, GGMLWeight | DeviceQuantized) else \
            cast(torch.Tensor, tensor).to(dtype_of(target))
    unexpected = [n for n in shards if n not in params]
    if unexpected:
        raise KeyError(f"unexpected weight {unexpected[0]!r}")
    missing = [n for n in params if n not in shards]
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    for name, parts in shards.items():
        module_name, attr = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        ordered = [parts[-1]] if -1 in parts else [parts[i] for i in sorted(parts)]
        if all(isinstance(p, DeviceQuantized) for p in ordered) and isinstance(module, Linear) and attr == "weight":
            kept = cast(list[DeviceQuantized], ordered)
            shape = getattr(module, attr).shape
            if sum(s.rows for s in kept) != shape[0] or kept[0].cols != shape[1]:
                raise RuntimeError(f"{name}: the checkpoint's quantized matrix does not fit {tuple(shape)}")
            module.keep_device_blocks(kept, blocks_linear)
            continue
        if all(isinstance(p, GGMLWeight) for p in ordered) and isinstance(module, Linear | Embedding) and \
                attr == "weight":
            segments = cast(list[GGMLWeight], ordered)
            shape = getattr(module, attr).shape
            if sum(s.rows for s in segments) != shape[0] or segments[0].cols != shape[1]:
                raise RuntimeError(f"{name}: checkpoint blocks do not fit {tuple(shape)}")
            if isinstance(module, Linear):
                if split is not None and split.on_host(name):
                    module.keep_ggml(segments)
                else:
                    module.keep_device_blocks(segments, blocks_linear)
                continue
            module.keep_device_blocks(segments[0], dense_rows, dtype)
            if tied and isinstance(model, LlamaForCausalLM):  # the logits read the same blocks
                model.tied_head = Linear(shape[1], shape[0], bias=False, device="meta")
                model.tied_head.keep_device_blocks(segments, blocks_linear)
            continue
        dense_parts = [dense(p).to(dtype_of(name)) if isinstance(p, GGMLWeight) else p.dense().to(dtype_of(name))
                       if isinstance(p, DeviceQuantized) else p for p in ordered]
        tensor = dense_parts[0] if len(dense_parts) == 1 else torch.cat(dense_parts)
        shape = getattr(module, attr).shape
        if tensor.numel() != shape.numel():
            raise RuntimeError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not fit {tuple(shape)}")
        setattr(module, attr, nn.Parameter(tensor.reshape(shape).contiguous(), requires_grad=False))


def load_to_device(model: ModelSpec | str | Path, dtype: torch.dtype | str = "bfloat16", device: str = "cuda",
                   gpu_memory_utilization: float = 0.9, mmproj: str | Path | None = None,
                   gguf_blocks: bool = True, split: LayerSplit | None = None) -> LoadedModel:
    """A Llama-family decoder from a .gguf file or a safetensors directory (a ModelSpec, or its path), its weights
    on ``device`` in ``dtype`` (see the module docstring); ``gguf_blocks``: a GGUF's matrices stay in their blocks
    where the kernel reads their type (else every weight is dequantized to ``dtype`` at load); ``split``: its first
    layers kept on the CPU (runlm.models.offload)."""
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
    sizes = weight_bytes_on_device(spec, itemsize, KEPT_TYPES if gguf_blocks else ())
    check_fits(sum(size for name, size in sizes.items() if split is None or not split.on_host(name)), dev,
               gpu_memory_utilization, path.name)
    if spec.gguf is not None:
        gguf = spec.gguf
        model_ = _empty_model(cfg, rope_freq_factors(gguf))
        weights = _gguf_tensors(gguf, cfg, dev, stats, gguf_blocks, split)
    else:
        model_ = _empty_model(cfg)
        tensors = _safetensors_tensors(path, dev if split is None else HOST)
        if split is not None:  # (read on the host, the GPU layers' moved on)
            tensors = ((n, t if split.on_host(n) else t.to(dev)) for n, t in tensors)
        # (DeviceQuantized matrices among them, a pre-quantized checkpoint's: fill_parameters keeps them as they are)
        weights = cast(Iterator[tuple[str, Weight]], device_prequantized(tensors, spec.hf_config))
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
            fill_parameters(model_, weights, dtype, split)
    except (KeyError, RuntimeError) as exc:
        raise ModelFormatError(f"{path}: weights do not fit the {cfg.family} config: {exc}") from None
    model_ = _to_device(model_, dev, dtype, split).eval()
    if stats[0]:
        kept = [m for m in model_.modules() if isinstance(m, Linear) and m.device_blocks]
        tables = [m.device_blocks for m in model_.modules() if isinstance(m, Embedding) and m.device_blocks]
        held = sum(p.numel() * p.element_size() for p in model_.parameters()) + \
            sum(s.raw.numel() for m in kept if m is not getattr(model_, "tied_head", None) for s in m.device_blocks) + \
            sum(t.raw.numel() for t in tables if t is not None)
        log.info("%s: GGUF blocks (%.1f MiB as stored), %d matrices kept in their blocks, the rest dequantized on %s "
                 "to %s: the weights take %.1f MiB there (%.2fx the file's)", path.name, stats[0] / 2**20, len(kept),
                 dev, str(dtype).removeprefix("torch."), held / 2**20, held / stats[0])
    quantized = [s for m in model_.modules() if isinstance(m, Linear) for s in m.device_blocks
                 if isinstance(s, DeviceQuantized)]
    if quantized:
        log.info("%s: %d pre-quantized matrices kept as stored on %s (%.1f MiB), multiplied in their format", path.name,
                 len(quantized), dev, sum(s.nbytes for s in quantized) / 2**20)
    model_.model.fused = False
    # (mixtures of experts: the fused kernel's stacked weights; a split's CPU layers route on the host)
    stack_model_experts(model_, first_layer=0 if split is None else split.host_layers)
    if split is not None:
        offload_layers(model_, split, dev, dtype)
        log.info("%s: %d of %d layers on %s: %s", path.name, split.gpu_layers, split.num_layers, dev,
                 split.describe())
    vision = None
    if family is not None:
        assert spec.hf_config is not None
        vision = vlm.build_hf(path, spec.hf_config, [(n, t.float().cpu()) for n, t in vision_weights], tokenizer)
    elif spec.projector is not None:
        vision = vlm.build_mmproj(spec.projector, tokenizer)
    if vision is not None:  # the tower on the device in float32 (its numerics: transformers'), its rows cast
        vision = vision.to(device=dev)  # to the model's dtype as they are written over the placeholders
    return LoadedModel(model_, cfg, tokenizer, path, vision, offload=split)


def move_to_device(model: LlamaForCausalLM, device: torch.device) -> LlamaForCausalLM:
    """A model loaded on the host (load_to_device(device="cpu")) moved whole to ``device``, the matrices it keeps in
    their blocks too (tensor parallelism: each rank cuts its part on the host, then moves only that)."""
    model = model.to(device=device)
    for module in model.modules():
        if isinstance(module, Linear) and module.device_blocks:
            if not all(isinstance(s, GGMLWeight) for s in module.device_blocks):
                raise ValueError("a pre-quantized checkpoint's matrices are not moved between devices")
            module.keep_device_blocks([GGMLWeight(s.raw.to(device), s.qtype, s.rows, s.cols)
                                       for s in module.device_blocks], module._blocks_forward.func)
        elif isinstance(module, Embedding) and module.device_blocks is not None:
            t = module.device_blocks
            module.keep_device_blocks(GGMLWeight(t.raw.to(device), t.qtype, t.rows, t.cols), module._rows,
                                      module.rows_dtype)
    return model


def held_bytes(model: nn.Module) -> int:
    """The bytes a model's weights take where they are: parameters, and the matrices kept in their blocks."""
    blocks = {id(s.raw): s.raw.numel() * s.raw.element_size() for m in model.modules()
              for s in (m.device_blocks if isinstance(m, Linear) else
                        [m.device_blocks] if isinstance(m, Embedding) and m.device_blocks is not None else [])
              if isinstance(s, GGMLWeight)}
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(blocks.values())


def _to_device(model: LlamaForCausalLM, dev: torch.device, dtype: torch.dtype, split: LayerSplit | None
               ) -> LlamaForCausalLM:
    """The model on ``dev`` in ``dtype``, but for a split's CPU layers (float32, on the host)."""
    if split is None:
        return model.to(device=dev, dtype=dtype)
    layers = model.model.layers
    kept = [layers[i] for i in range(split.host_layers)]
    for i in range(split.host_layers):
        layers[i] = nn.Identity()
    model = model.to(device=dev, dtype=dtype)
    for i, layer in enumerate(kept):
        layers[i] = layer.to(device=HOST, dtype=HOST_DTYPE)
    return model

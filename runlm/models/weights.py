"""Read a decoder's config and weights from a GGUF file or a safetensors directory.

Weights are yielded under Hugging Face names so one ``load_weights`` serves both formats.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, overload

import torch

from runlm.formats import ModelFormatError
from runlm.formats.architectures import gguf_rope_interleaved
from runlm.formats.gguf import ggml_type
from runlm.formats.gguf_names import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES, GGUF_LAYER_PARAMS
from runlm.formats.safetensors import SafetensorsDir
from runlm.formats.safetensors import read_hf_config as read_hf_config  # (its home: torch-free readers)
from runlm.kernels import ggml
from runlm.kernels.linear import dequantize_blocks
from runlm.models import families
from runlm.models.config import ModelConfig
from runlm.models.linear import BlockQuantized, GGMLWeight, Weight

if TYPE_CHECKING:
    from runlm.formats.gguf import GGUFFile

# tensors that configure the model rather than weigh it (RoPE factors: see ModelConfig.from_gguf)
_GGUF_NOT_WEIGHTS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


def hf_name_for_gguf(name: str, arch: str = "llama") -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (None for non-weights)."""
    family = families.for_gguf(arch)  # its own names where they differ from Llama's (Gemma's norms, Phi-3's fused)
    layer_names = {**GGUF_LAYER_NAMES, **family.gguf_tensor_names} if family else GGUF_LAYER_NAMES
    m = re.fullmatch(r"blk\.(\d+)\.([\w.]+)\.(weight|bias)", name)  # (LFM2: "shortconv.conv")
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+(?:\.bias)?)", name)
    params = {**GGUF_LAYER_PARAMS, **family.gguf_tensor_names} if family else GGUF_LAYER_PARAMS
    if m and m.group(2) in params:
        return f"model.layers.{m.group(1)}.{params[m.group(2)]}"
    if m and m.group(2) in layer_names:  # a module's weight written without ".weight" (Falcon-H1's ffn_norm)
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.weight"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    global_names = {**GGUF_GLOBAL_NAMES, **family.gguf_global_names} if family else GGUF_GLOBAL_NAMES
    if m and m.group(1) in global_names:
        return f"{global_names[m.group(1)]}.{m.group(2)}"
    return None


def gguf_qk_rows_turned(architecture: str, cfg: ModelConfig, mode: str) -> bool:
    """Whether a GGUF file's Q/K rows are loaded turned back from llama.cpp's interleaved RoPE layout to halves: in
    the dense modes always (for an architecture whose converter permutes them), and in "ggml" mode where RoPE
    rotates only part of each head (Bamba's half): the converter permutes whole heads, so the rotated features'
    pairs do not sit side by side in the stored rows (llama.cpp itself rotates neighbours there, not transformers'
    pairs). Elsewhere "ggml" mode rotates the stored rows as they are."""
    return gguf_rope_interleaved(architecture) and (mode != "ggml" or cfg.rotary_dim < cfg.head_dim)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's permute: interleaved RoPE pairs back to rotate-half halves."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def gguf_weights(gguf: GGUFFile, cfg: ModelConfig, mode: str = "dense",
                 load: Callable[[str], torch.Tensor] | None = None,
                 block_types: frozenset[str] = frozenset()) -> Iterator[tuple[str, Weight]]:
    """HF-named weights of a GGUF decoder, in one of four forms (``load``: how a tensor is read dense, fp32; the
    host's dequantizer by default, the GPU runner's on its device):

    * "dense": dequantized fp32 tensors, Q/K permuted back to the rotate-half layout;
    * "int8": the same, but matrices stored in a 32-value block type come as BlockQuantized;
    * "ggml": matrices in a type ggml computes on come as GGMLWeight views of the mapped file, and
      nothing is permuted: the model rotates Q/K in the stored layout (``gguf_rope_interleaved``) -- but where
      RoPE rotates part of each head (see gguf_qk_rows_turned), whose Q/K rows come turned (copies, not views);
    * "blocks": "dense", but matrices stored in one of ``block_types`` come as GGMLWeight (Q/K rows turned back
      whole: a row's blocks move with it), for the GPU runner to keep as stored.
    """
    permute = gguf_qk_rows_turned(gguf.architecture, cfg, mode)
    load = load or gguf.load
    for name, info in gguf.tensors.items():
        if name in _GGUF_NOT_WEIGHTS:
            continue
        hf = hf_name_for_gguf(name, gguf.architecture)
        if hf is None:
            raise ModelFormatError(f"{gguf.path}: tensor {name!r} is not part of a {gguf.architecture} decoder")
        if "{e}" in hf:
            yield from _experts(gguf, name, hf, mode, load, block_types)
            continue
        matrix = hf.endswith(".weight") and len(info.shape) == 2
        heads = cfg.num_heads if ".q_proj." in hf else cfg.num_kv_heads if ".k_proj." in hf else 0
        if matrix and (mode == "ggml" and info.qtype != "F32" and ggml.supported(ggml_type(info.qtype))
                       or mode == "blocks" and info.qtype in block_types):
            raw = gguf.raw_tensor(name)
            yield hf, GGMLWeight(_unpermute(raw, heads).contiguous() if permute and heads else raw,
                                 ggml_type(info.qtype), *info.shape)
            continue
        blocks = gguf.load_block_parts(name) if mode == "int8" and matrix else None
        # q, d, m and the dense tensor they give (multiply, then add: the dequantizer's own floats)
        parts = [load(name)] if blocks is None else [*blocks, dequantize_blocks(*blocks)]
        if permute and heads:
            parts = [_unpermute(t, heads) for t in parts]
        if hf.endswith(".A_log"):  # (the file's A = -exp(A_log))
            parts = [torch.log(-parts[0].float())]
        yield hf, parts[0] if len(parts) == 1 else BlockQuantized(*parts)
    family = families.for_gguf(gguf.architecture)
    if family is not None and family.gguf_metadata_weights is not None:
        for hf, value in family.gguf_metadata_weights(gguf.metadata, cfg.num_layers).items():
            yield hf, torch.tensor(value, dtype=torch.float32)


def _experts(gguf: GGUFFile, name: str, template: str, mode: str, load: Callable[[str], torch.Tensor],
             block_types: frozenset[str]) -> Iterator[tuple[str, Weight]]:
    """One weight per expert of a stacked [experts, rows, cols] tensor: views of the file's blocks in "ggml"
    mode, and in "blocks" mode where stored in one of ``block_types`` (the experts stay quantized), dequantized
    fp32 otherwise."""
    info = gguf.tensors[name]
    if len(info.shape) == 2:  # the experts' biases (gpt-oss): [experts, rows]
        for e, bias in enumerate(load(name)):
            yield template.format(e=e), bias
        return
    experts, rows, cols = info.shape
    if mode == "ggml" and info.qtype != "F32" and ggml.supported(ggml_type(info.qtype)) or \
            mode == "blocks" and info.qtype in block_types:
        raw = gguf.raw_tensor(name).view(experts, rows, -1)
        for e in range(experts):
            yield template.format(e=e), GGMLWeight(raw[e], ggml_type(info.qtype), rows, cols)
        return
    stacked = load(name)
    for e in range(experts):
        yield template.format(e=e), stacked[e]


# half-precision safetensors dtypes -> the ggml type that computes on them as stored
_HALF_TYPES = {"BF16": "BF16", "F16": "F16"}
# safetensors' dtypes (ggml's names where ggml has the type) as torch reads them
_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                 "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8,
                 "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@overload
def safetensors_weights(source: Path | SafetensorsDir, mode: Literal["dense"] = ...,
                        hf_config: Mapping[str, Any] | None = None) -> Iterator[tuple[str, torch.Tensor]]: ...
@overload
def safetensors_weights(source: Path | SafetensorsDir, mode: str,
                        hf_config: Mapping[str, Any] | None = None) -> Iterator[tuple[str, Weight]]: ...


def safetensors_weights(source: Path | SafetensorsDir, mode: str = "dense",
                        hf_config: Mapping[str, Any] | None = None) -> Iterator[tuple[str, Weight]]:
    """HF-named tensors of a model directory (its files mapped once: a ModelSpec's SafetensorsDir, or the
    directory's path), as float32; in "ggml" mode bf16/fp16 matrices come as GGMLWeight views of the mapped file
    instead (half the bytes, pages shared between processes). FP8 matrices with their scales (runlm.models.
    prequantized) come dequantized, or in "ggml" mode repacked to Q8_0 blocks. ``hf_config``: the directory's
    config.json as read already (its quantization_config says how such matrices are stored)."""
    import warnings

    from runlm.models import prequantized as fp8

    st = source if isinstance(source, SafetensorsDir) else SafetensorsDir(source)
    if hf_config is None and (st.directory / "config.json").is_file():
        hf_config = read_hf_config(st.directory)
    block, int4 = fp8.block_size(hf_config), fp8.int4_method(hf_config)
    scales = {fp8.scale_name(n, st.tensors) for n in st.tensors if st.tensors[n].qtype.startswith("F8_")}
    repacker = fp8.Q8Repacker()
    for name in sorted(st.tensors):
        info = st.tensors[name]
        if name in scales or name.endswith(fp8.SKIPPED_SUFFIXES):
            continue  # (read with the weight they scale)
        if name.endswith("_scales") and name[:-len("scales")] + "blocks" in st.tensors:
            continue  # (an MXFP4 stack's, read with its blocks)
        if name.endswith("_blocks") and name[:-len("blocks")] + "scales" in st.tensors:
            base = name[:-len("_blocks")]  # gpt-oss's MXFP4 experts: as stored in fast mode
            stack = fp8.Mxfp4Stack(torch.from_numpy(st.raw(name).copy()).reshape(info.shape),
                                   torch.from_numpy(st.raw(base + "_scales").copy()).reshape(
                                       st.tensors[base + "_scales"].shape))
            # (a stack runlm.models.moe.stacked_experts splits into experts' blocks)
            yield base, cast(Weight, stack) if mode == "ggml" and ggml.supported(ggml_type("MXFP4")) \
                else stack.dense()
            continue
        if int4 is not None and name.endswith(fp8.INT4_SUFFIXES):
            if name.endswith(".qweight"):  # GPTQ's or AWQ's 4-bit matrix: its weight, as dense or Q8_0 blocks
                base = name[:-len("qweight")]
                g_idx = _int32(st, base + "g_idx") if base + "g_idx" in st.tensors else None
                dense = fp8.dequantize_int4(int4[0], int4[1], _int32(st, name), _int32(st, base + "qzeros"),
                                            torch.from_numpy(st.load_array(base + "scales")), g_idx)
                yield base + "weight", repacker.repack(dense) if mode == "ggml" and dense.shape[1] % 32 == 0 \
                    else dense
            continue
        with warnings.catch_warnings():  # read-only memory: torch warns, nothing writes it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(st.raw(name))
        scale = fp8.scale_name(name, st.tensors) if info.qtype.startswith("F8_") else None
        if scale is not None:  # an FP8 matrix and its scale: their product, as dense or Q8_0 blocks
            values = raw.reshape(-1).view(_TORCH_DTYPES[info.qtype]).reshape(info.shape).to(torch.float32)
            dense = fp8.dequantize_fp8(values, torch.from_numpy(st.load_array(scale)), block)
            yield name, repacker.repack(dense) if mode == "ggml" and dense.shape[1] % 32 == 0 else dense
            continue
        if mode == "ggml" and info.qtype in _HALF_TYPES and len(info.shape) == 2 and name.endswith(".weight") \
                and ggml.supported(ggml_type(info.qtype)):
            yield name, GGMLWeight(raw, ggml_type(info.qtype), *info.shape)
        elif info.qtype not in _TORCH_DTYPES:
            raise ModelFormatError(f"{st.directory}: tensor {name!r} is {info.qtype}, which runlm does not read")
        else:
            yield name, raw.reshape(-1).view(_TORCH_DTYPES[info.qtype]).reshape(info.shape).to(torch.float32,
                                                                                                copy=True)
    repacker.log(st.directory)


def _int32(st: SafetensorsDir, name: str) -> torch.Tensor:
    """A packed int32 tensor as stored (load_array would widen it to floats)."""
    info = st.tensors[name]
    return torch.from_numpy(st.raw(name).copy()).view(torch.int32).reshape(info.shape)


_W = TypeVar("_W")


def hf_renamed(weights: Iterable[tuple[str, _W]], family: str) -> Iterator[tuple[str, _W]]:
    """A checkpoint's tensors under the torch model's names, where the family's differ (Family.hf_tensor_names)."""
    names = families.get(family).hf_tensor_names
    for name, tensor in weights:
        for theirs, ours in names.items():
            name = name.replace(theirs, ours)
        yield name, tensor


def rope_freq_factors(gguf: GGUFFile) -> torch.Tensor | None:
    return gguf.load("rope_freqs.weight") if "rope_freqs.weight" in gguf.tensors else None

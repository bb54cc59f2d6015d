"""A safetensors model folder written as a GGUF file (F32, F16 or BF16), so runlm can quantize it: what llama.cpp's
``convert_hf_to_gguf.py`` writes for the dense families people quantize most (Llama and Mistral as ``llama``,
Qwen2, Qwen3), from our own reading of the files. The tensors are upstream's byte for byte (names, Llama's Q/K
permutation for interleaved RoPE, norms and biases kept F32, the same rounding); the metadata is the keys it
writes for them, with the tokenizer's vocabulary, token types, merges and special ids. The one difference: the
pre-tokenizer's name is read from ``tokenizer.json`` (its split regex, or a plain byte-level split as ``gpt-2``)
where upstream hashes a probe text's ids against a table of known tokenizers.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from runlm.formats import ModelFormatError
from runlm.formats.gguf_names import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES
from runlm.formats.safetensors import SafetensorsDir
from runlm.formats.tokenizer import PRE_TOKENIZER_SPLITS

# Hugging Face architecture -> (GGUF architecture, whether Q and K are permuted for interleaved RoPE)
ARCHITECTURES = {"LlamaForCausalLM": ("llama", True), "MistralForCausalLM": ("llama", True),
                 "Qwen2ForCausalLM": ("qwen2", False), "Qwen3ForCausalLM": ("qwen3", False)}
_LAYER = {hf: gguf for gguf, hf in GGUF_LAYER_NAMES.items() if "{e}" not in hf}  # (no experts here)
_GLOBAL = {hf: gguf for gguf, hf in GGUF_GLOBAL_NAMES.items()}
# the canonical llama.cpp name of each split regex runlm knows
_PRE_NAMES = {"llama-bpe": PRE_TOKENIZER_SPLITS["llama-bpe"], "qwen2": PRE_TOKENIZER_SPLITS["qwen2"],
              "qwen35": PRE_TOKENIZER_SPLITS["qwen35"], "tekken": PRE_TOKENIZER_SPLITS["tekken"],
              "gpt-4o": PRE_TOKENIZER_SPLITS["gpt-4o"]}
OUT_TYPES = ("auto", "f32", "f16", "bf16")
NORMAL, UNUSED, CONTROL, USER_DEFINED = 1, 5, 3, 4


def _read_json(path: Path) -> dict[str, Any]:
    from runlm.sizes import read_small_text

    if not path.is_file():
        return {}
    data = json.loads(read_small_text(str(path), 64 << 20, "convert"))
    return data if isinstance(data, dict) else {}


def gguf_name(hf: str) -> str | None:
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight' (None: not a tensor GGUF keeps)."""
    stem, _, kind = hf.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{kind}"
    parts = stem.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER:
        return f"blk.{parts[2]}.{_LAYER[parts[3]]}.{kind}"
    return None


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's permute: rotate-half pairs of each head to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _pre_tokenizer(folder: Path, spec: dict[str, Any]) -> str:
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    split = next((s for s in steps if s.get("type") == "Split"), None)
    regex = ((split or {}).get("pattern") or {}).get("Regex")
    for name, known in _PRE_NAMES.items():
        if regex == known:
            return name
    raise ModelFormatError(f"{folder.name}: its tokenizer's pre-tokenizer ({', '.join(map(str, kinds))}) is not one "
                           f"runlm can name for llama.cpp; convert it with llama.cpp's convert_hf_to_gguf.py")


def _vocab(folder: Path, vocab_size: int) -> dict[str, Any]:
    """tokenizer.ggml.* for a byte-level BPE tokenizer (tokenizer.json), as convert_hf_to_gguf writes them."""
    spec = _read_json(folder / "tokenizer.json")
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ModelFormatError(f"{folder.name}: runlm converts byte-level BPE tokenizers (tokenizer.json); this one "
                               f"is {model.get('type') or 'missing'}")
    by_id = {int(i): t for t, i in model.get("vocab", {}).items()}
    added = {int(a["id"]): a for a in spec.get("added_tokens", [])}
    by_id.update({i: a["content"] for i, a in added.items()})
    tokens, types = [], []
    for i in range(max(vocab_size, len(by_id))):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(NORMAL if i not in added else CONTROL if added[i].get("special") else USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    out: dict[str, Any] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": _pre_tokenizer(folder, spec),
                           "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                           "tokenizer.ggml.merges": merges}
    config = _read_json(folder / "tokenizer_config.json")
    ids = {t: i for i, t in by_id.items()}
    for key, name in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and token in ids:
            out[f"tokenizer.ggml.{name}_token_id"] = ids[token]
    post = json.dumps(spec.get("post_processor") or {})
    bos = config.get("bos_token")
    out["tokenizer.ggml.add_bos_token"] = bool(config.get("add_bos_token", isinstance(bos, str) and bos in post))
    template = (folder / "chat_template.jinja").read_text() if (folder / "chat_template.jinja").is_file() \
        else config.get("chat_template")
    if isinstance(template, str):
        out["tokenizer.chat_template"] = template
    return out


def _hparams(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    text: dict[str, Any] = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ModelFormatError(f"RoPE scaling {rope.get('rope_type') or rope.get('type')!r} is not something runlm "
                               f"converts; use llama.cpp's convert_hf_to_gguf.py")
    heads, hidden = int(text["num_attention_heads"]), int(text["hidden_size"])
    out: dict[str, Any] = {
        "block_count": int(text["num_hidden_layers"]), "context_length": int(text.get("max_position_embeddings", 2048)),
        "embedding_length": hidden, "feed_forward_length": int(text["intermediate_size"]),
        "attention.head_count": heads, "attention.head_count_kv": int(text.get("num_key_value_heads") or heads),
        "rope.freq_base": float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        "attention.layer_norm_rms_epsilon": float(text.get("rms_norm_eps", 1e-6))}
    if text.get("head_dim") is not None:
        out["attention.key_length"] = out["attention.value_length"] = int(text["head_dim"])
    if arch == "llama":
        out["vocab_size"] = int(text["vocab_size"])
        out["rope.dimension_count"] = int(text.get("head_dim") or hidden // heads)
    return out


def convert_folder(folder: Path, target: Path, out_type: str = "auto",
                   progress: Callable[[int, int], None] | None = None) -> str:
    """Write the safetensors model in ``folder`` as the GGUF file ``target``; returns the type written (F16...)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    cfg = _read_json(folder / "config.json")
    hf_arch = (cfg.get("architectures") or ["?"])[0]
    if hf_arch not in ARCHITECTURES:
        raise ModelFormatError(f"{folder.name}: runlm converts {', '.join(ARCHITECTURES)} to GGUF, not {hf_arch}; "
                               f"use llama.cpp's convert_hf_to_gguf.py for it")
    if out_type not in OUT_TYPES:
        raise ValueError(f"the GGUF type must be one of {', '.join(OUT_TYPES)}, not {out_type!r}")
    arch, permute = ARCHITECTURES[hf_arch]
    weights = SafetensorsDir(folder)
    if out_type == "auto":  # convert_hf_to_gguf's: bf16 where the weights are, else f16
        kinds = {t.qtype for t in weights.tensors.values()}
        out_type = "bf16" if "BF16" in kinds else "f16"
    matrix_type = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16}[out_type]
    params = _hparams(cfg, arch)
    writer = gguf.GGUFWriter(str(target), arch)
    writer.add_type("model")
    writer.add_name(folder.name)
    for key, value in params.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_file_type({"f32": 0, "f16": 1, "bf16": 32}[out_type])
    writer.add_quantization_version(2)
    for key, value in _vocab(folder, int(cfg.get("vocab_size") or 0)).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    names = [(n, gguf_name(n)) for n in weights.tensors]
    unknown = [n for n, g in names if g is None and not n.endswith("rotary_emb.inv_freq")]
    if unknown:
        raise ModelFormatError(f"{folder.name}: tensors runlm does not know how to convert: {', '.join(unknown[:5])}")
    heads, kv_heads = params["attention.head_count"], params["attention.head_count_kv"]
    for i, (hf, name) in enumerate(names):
        if name is None:
            continue
        data = weights.load_array(hf)
        if permute and name.endswith("attn_q.weight"):
            data = _permute(data, heads)
        elif permute and name.endswith("attn_k.weight"):
            data = _permute(data, kv_heads)
        kind = T.F32 if data.ndim <= 1 or name.endswith("_norm.weight") else matrix_type
        writer.add_tensor(name, gguf.quants.quantize(data, kind) if kind != T.F32 else data, raw_dtype=kind)
        if progress is not None:
            progress(i + 1, len(names))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_type.upper()

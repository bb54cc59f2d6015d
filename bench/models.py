"""Benchmark models: random-weight, real-shaped, in both formats from the same tensors.

``qwen2.5-0.5b-shape`` is Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
ffn 4864, vocab 151936, tied embeddings) with random fp32 weights: saved as a safetensors
directory for runlm and transformers, and written to an F32 GGUF (llama.cpp's ``qwen2``
architecture) for llama.cpp, so every peer computes with identical weights. The tokenizer is
smollm2's; its vocabulary is padded with unused tokens up to the model's 151936 rows, because
llama.cpp sizes the embedding from the token list. Built once under ``.cache/bench-models``.

    .venv/bin/python -m bench.models            # build them
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = Path(os.environ.get("RUNLM_BENCH_CACHE", ROOT / ".cache" / "bench-models"))

SHAPES = {
    "qwen2.5-0.5b-shape": dict(
        vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2),
    # the sizes people run on a CPU: written straight to an F16 GGUF (no safetensors, no transformers)
    "qwen2.5-1.5b-shape": dict(
        arch="qwen2", vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "qwen2.5-3b-shape": dict(
        arch="qwen2", vocab_size=151936, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, intermediate_size=11008, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "llama3.1-8b-shape": dict(
        arch="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}
# shapes too big to build through transformers in fp32: random F16 tensors written as the GGUF directly
DIRECT = ("qwen2.5-1.5b-shape", "qwen2.5-3b-shape", "llama3.1-8b-shape")


def build_safetensors(name: str) -> Path:
    from tests.fixtures.models import _staging, smollm2_tokenizer_dir

    target = CACHE / name
    if (target / "model.safetensors").exists():
        return target
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[name])).to(torch.float32)
    with _staging(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir())).save_pretrained(tmp)
    return target


# Hugging Face parameter fragment -> llama.cpp tensor name fragment
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    parts = hf.split(".")  # model.layers.N.<module>.<sub>.weight|bias
    return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def build_gguf(name: str) -> Path:
    """The shape's unquantized GGUF with smollm2's tokenizer (padded): the safetensors weights as F32,
    or for the DIRECT shapes random F16 tensors (seeded; the std of transformers' initializer)."""
    import gguf

    target = CACHE / (f"{name}.f16.gguf" if name in DIRECT else f"{name}.f32.gguf")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    w = _header(gguf.GGUFWriter(str(tmp), SHAPES[name].get("arch", "qwen2")), name)
    if name in DIRECT:
        _write_random(w, name)
    else:
        from safetensors.numpy import load_file

        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        tie = SHAPES[name]["tie_word_embeddings"]
        for hf, array in load_file(str(build_safetensors(name) / "model.safetensors")).items():
            if not (hf == "lm_head.weight" and tie):
                w.add_tensor(gguf_name(hf), np.ascontiguousarray(array, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    w.close()
    os.replace(tmp, target)
    return target


def _tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and numpy shapes ([rows, columns]) of a Llama/Qwen2 decoder."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    out = [("token_embd.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        out += [(f"blk.{n}.attn_norm.weight", (h,)), (f"blk.{n}.attn_q.weight", (h, h)),
                (f"blk.{n}.attn_k.weight", (kv, h)), (f"blk.{n}.attn_v.weight", (kv, h))]
        if cfg.get("arch", "qwen2") == "qwen2":
            out += [(f"blk.{n}.attn_q.bias", (h,)), (f"blk.{n}.attn_k.bias", (kv,)), (f"blk.{n}.attn_v.bias", (kv,))]
        out += [(f"blk.{n}.attn_output.weight", (h, h)), (f"blk.{n}.ffn_norm.weight", (h,)),
                (f"blk.{n}.ffn_gate.weight", (i, h)), (f"blk.{n}.ffn_up.weight", (i, h)),
                (f"blk.{n}.ffn_down.weight", (h, i))]
    out.append(("output_norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("output.weight", (v, h)))
    return out


def _write_random(w, name: str) -> None:
    """Tensor by tensor (the whole model is never in memory): weights N(0, 0.02) in F16, norms 1 and
    biases 0 in F32, as llama.cpp's converter stores 1-D tensors."""
    import gguf

    shapes = _tensor_shapes(SHAPES[name])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for tname, shape in shapes:
        dtype = np.float16 if len(shape) == 2 else np.float32
        w.add_tensor_info(tname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for tname, shape in shapes:
        if len(shape) == 1:
            w.write_tensor_data(np.full(shape, 1.0 if tname.endswith("norm.weight") else 0.0, np.float32))
            continue
        array = np.empty(shape, np.float16)
        for r in range(0, shape[0], 4096):  # (in slices: an fp32 copy of the embedding alone is ~1 GB)
            part = rng.standard_normal((min(4096, shape[0] - r), shape[1]), dtype=np.float32)
            array[r:r + part.shape[0]] = part * 0.02
        w.write_tensor_data(array)


def _header(w, name: str):
    """The hyperparameters and smollm2's tokenizer, padded to the shape's vocabulary."""
    import gguf

    from runlm.catalog import resolve_model

    cfg = SHAPES[name]
    src = gguf.GGUFReader(str(resolve_model("smollm2")))
    tokens = list(src.fields["tokenizer.ggml.tokens"].contents())
    types = list(src.fields["tokenizer.ggml.token_type"].contents())
    pad = cfg["vocab_size"] - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.UNUSED)] * pad
    w.add_name(name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(src.fields["tokenizer.ggml.pre"].contents())
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(src.fields["tokenizer.ggml.merges"].contents()))
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    return w


if __name__ == "__main__":
    for shape in sys.argv[1:] or SHAPES:
        print(build_gguf(shape) if shape in DIRECT else (build_safetensors(shape), build_gguf(shape)))

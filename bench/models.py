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
}


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
    """The safetensors weights as an F32 GGUF with smollm2's tokenizer (padded)."""
    import gguf
    from safetensors.numpy import load_file

    from runlm.catalog import resolve_model

    target = CACHE / f"{name}.f32.gguf"
    if target.exists():
        return target
    directory = build_safetensors(name)
    cfg = SHAPES[name]
    src = gguf.GGUFReader(str(resolve_model("smollm2")))
    tokens = list(src.fields["tokenizer.ggml.tokens"].contents())
    types = list(src.fields["tokenizer.ggml.token_type"].contents())
    pad = cfg["vocab_size"] - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.UNUSED)] * pad

    tmp = target.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), "qwen2")
    w.add_name(name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(src.fields["tokenizer.ggml.pre"].contents())
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(src.fields["tokenizer.ggml.merges"].contents()))
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    for hf, array in load_file(str(directory / "model.safetensors")).items():
        if hf == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        w.add_tensor(gguf_name(hf), np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, target)
    return target


if __name__ == "__main__":
    for shape in SHAPES:
        print(build_safetensors(shape), build_gguf(shape))

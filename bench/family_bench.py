"""Every model family on a Q4_K_M file of a generated model: runlm's fast mode against llama.cpp.

Each family of tests/fixtures/models.py (Llama, Gemma 2 and 3, Phi-3, the mixtures of experts, GLM-4, gpt-oss) is
built at a benchmark shape (hidden 512, 12 layers, 8 heads of 64, random weights, smollm2's tokenizer),
written by llama.cpp's own converter (f16) and quantizer (Q4_K_M), then decoded greedily by both peers in
child processes, alternating round by round (bench/quant_bench.py's children). llama.cpp cannot read the
Phi-3 file's substituted BPE vocabulary (tests/fixtures/gguf_convert.py), so Phi-3 is compared with runlm's
torch runner instead (``runlm-torch``: the same file with RUNLM_NATIVE_RUNNER=0).

Writes bench/results/family_bench.json and .md.

    .venv/bin/python bench/family_bench.py [--families gemma2,gemma3] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.models import CACHE  # noqa: E402
from bench.quant_bench import RESULTS, _run_child, cpu_name, prompt_ids, quantize  # noqa: E402

FAMILIES = ("llama", "gemma2", "gemma3", "phi3", "mixtral", "qwen2-moe", "qwen3-moe", "olmoe", "glm4", "gpt-oss")
NO_LLAMA_CPP = frozenset({"phi3"})
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
# what each recipe sizes by its own name (experts, Gemma's query scale, LongRoPE's per-frequency factors)
EXTRA = {
    "gemma2": dict(query_pre_attn_scalar=64), "gemma3": dict(query_pre_attn_scalar=64),
    "phi3": dict(original_max_position_embeddings=512, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [1.0 + i / 2 for i in range(16)],
        "partial_rotary_factor": 0.5}),
    "mixtral": dict(intermediate_size=768),
    "qwen2-moe": dict(moe_intermediate_size=768, shared_expert_intermediate_size=1536),
    "qwen3-moe": dict(moe_intermediate_size=768),
    "olmoe": dict(intermediate_size=768, num_key_value_heads=8),
    # gpt-oss-20b's proportions: 32 experts as wide as the model, 4 a token, a 128-token window every other layer
    "gpt-oss": dict(intermediate_size=512, num_local_experts=32, num_experts_per_tok=4, sliding_window=128),
}


def family_file(recipe: str) -> Path:
    """The recipe at the benchmark shape as a Q4_K_M GGUF (built, converted and quantized once)."""
    target = CACHE / f"family-{recipe}.q4_k_m.gguf"
    if target.exists():
        return target
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.fixtures.gguf_convert import convert_dir
    from tests.fixtures.models import _COMMON, RECIPES, _staging, smollm2_tokenizer_dir

    source = CACHE / f"family-{recipe}"
    if not (source / "model.safetensors").exists() and not (source / "model.safetensors.index.json").exists():
        cls_name, overrides = RECIPES[recipe]
        config = getattr(transformers, cls_name)(**{**_COMMON, **overrides, **SHAPE, **EXTRA.get(recipe, {}),
                                                    "initializer_range": 0.02})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with _staging(source) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir())).save_pretrained(tmp)
    f16 = convert_dir(source, CACHE / f"family-{recipe}-gguf" / f"{recipe}.f16.gguf", "f16")
    return quantize(f16, target, "q4_k_m")


def _decode_tok_s(peer: str, path: Path, ids: list[int], args: argparse.Namespace) -> float:
    """A child's decode speed; ``runlm-torch`` is runlm's fast mode on the torch runner."""
    if peer != "runlm-torch":
        return float(_run_child(peer, path, ids, args)["decode_tok_s"])
    old = os.environ.get("RUNLM_NATIVE_RUNNER")
    os.environ["RUNLM_NATIVE_RUNNER"] = "0"
    try:
        return float(_run_child("runlm-fast", path, ids, args)["decode_tok_s"])
    finally:
        if old is None:
            del os.environ["RUNLM_NATIVE_RUNNER"]
        else:
            os.environ["RUNLM_NATIVE_RUNNER"] = old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}; {args.threads} threads", flush=True)
    results: dict[str, dict] = {}
    for recipe in args.families.split(","):
        path = family_file(recipe)
        ids = prompt_ids(path, args.prompt_tokens)
        peers = ["runlm-fast"] + (["runlm-torch"] if recipe in NO_LLAMA_CPP else ["llamacpp"])
        runs: dict[str, list[float]] = {p: [] for p in peers}
        for _ in range(args.rounds):
            for peer in peers:
                runs[peer].append(_decode_tok_s(peer, path, ids, args))
        results[recipe] = {"file": str(path), "size_bytes": path.stat().st_size,
                           "decode_tok_s": {p: statistics.median(v) for p, v in runs.items()}, "runs": runs}
        print(recipe, results[recipe]["decode_tok_s"], flush=True)
    lines = ["| family | file MB | runlm fast decode tok/s | peer | peer tok/s | ratio |", "|---|---|---|---|---|---|"]
    for recipe, r in results.items():
        ours = r["decode_tok_s"]["runlm-fast"]
        peer, theirs = next((p, v) for p, v in r["decode_tok_s"].items() if p != "runlm-fast")
        lines.append(f"| {recipe} | {r['size_bytes'] / 1e6:.0f} | {ours:.1f} | {peer} | {theirs:.1f} | "
                     f"{ours / theirs:.2f}x |")
    report = "\n".join(lines)
    print(f"\nCPU: {cpu_name()}; {args.threads} threads\n\n{report}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "family_bench.json").write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads,
                                                           "args": vars(args), "results": results}, indent=2))
    (RESULTS / "family_bench.md").write_text(report + "\n")


if __name__ == "__main__":
    main()

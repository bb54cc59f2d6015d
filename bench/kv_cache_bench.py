"""The native runner's KV caches against the fp32 one: fp16 (its default) and 8-bit (--kv-cache-dtype q8_0), beside
llama.cpp's own q8_0 cache.

Three measurements on one file (default smollm2, Q4_1):

- **KL**: mean KL divergence of the next-token distribution with an fp16 and a q8_0 cache against the same
  runner's fp32 cache, over the first ``--positions`` tokens of ``runlm.models.evaluate.english_text()`` in one
  context (a long-ish one: the cache's error accumulates over the positions attention reads). runlm: the native
  runner's fp16 and q8_0 caches against its fp32 cache; llama.cpp (llama-cpp-python, ``flash_attn=True``, which its
  quantized V cache needs): ``type_k = type_v = q8_0`` against its default f16 cache and against an f32 one.
  Each peer's logits come from a child process (llama.cpp's ggml and the one runlm links cannot share one).
- **KV bytes at ``--kv-context`` tokens** (8k): what the native runner allocates per dtype (its own allocation
  function), and the ratios fp16 / fp32 and q8_0 / fp32.
- **Decode speed at a long context**: tokens per second of ``--gen`` greedy tokens after a ``--context``-token
  prompt (the request's first-token to finished times), fp32 cache against fp16 and q8_0, children alternating for
  ``--rounds`` rounds.

    .venv/bin/python bench/kv_cache_bench.py --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.quant_bench import prompt_ids  # noqa: E402

DTYPES = ("fp32", "fp16", "q8_0")  # the native runner's caches (fp16: its default)
LLAMA_TYPES = {"f16": 1, "q8_0": 8}  # ggml_type values (an f32 cache, type 0, gave the f16 logits: not taken)


def model_path(name: str) -> Path:
    if name == "smollm2":
        from tests.fixtures.models import smollm2_gguf

        return smollm2_gguf()
    return Path(name)


def text_ids(path: Path, n: int) -> list[int]:
    ids = prompt_ids(path, n)
    if len(ids) < n:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {n}")
    return ids


# ---- children ---------------------------------------------------------------------------------------------------

def child_runlm_logits(path: Path, ids: list[int], out: Path) -> None:
    import numpy as np

    from runlm.engine.runners.native import native_model
    from runlm.engine.types.config import EngineConfig
    from runlm.models.evaluate import native_logits

    native = native_model(path, EngineConfig(model=str(path), max_model_len=len(ids)))
    if native is None:
        raise SystemExit("the native runner does not run this file")
    for dtype in DTYPES:
        np.save(out / f"runlm-{dtype}.npy", native_logits(native.model, ids, len(ids), dtype).numpy())


def child_llamacpp_logits(path: Path, ids: list[int], out: Path) -> None:
    import numpy as np
    from llama_cpp import Llama

    for name, ggml_type in LLAMA_TYPES.items():
        llm = Llama(str(path), n_ctx=len(ids), n_batch=len(ids), n_ubatch=len(ids), logits_all=True, flash_attn=True,
                    type_k=ggml_type, type_v=ggml_type, n_threads=os.cpu_count() or 2, verbose=False)
        llm.eval(ids)
        np.save(out / f"llamacpp-{name}.npy", np.array(llm.scores[:len(ids)], dtype=np.float32))
        del llm


def child_decode(path: Path, dtype: str, context: int, gen: int, threads: int | None) -> dict:
    from runlm.engine.llm import LLM
    from runlm.engine.types.sampling_params import SamplingParams

    ids = text_ids(path, context)
    llm = LLM(str(path), kv_cache_dtype=dtype, max_model_len=context + gen + 16, max_num_seqs=1, threads=threads,
              kv_cache_memory=str((context + gen + 64) * llm_bytes_per_token(path, dtype)))
    assert llm.engine.native, "the native runner does not run this file"
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=gen + 1, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    assert m is not None and m.first_token_time is not None and m.finished_time is not None
    return {"dtype": dtype, "prefill_s": m.first_token_time - m.arrival_time,
            "decode_tok_s": gen / (m.finished_time - m.first_token_time)}


def llm_bytes_per_token(path: Path, dtype: str) -> int:
    from runlm.formats.gguf import GGUFFile
    from runlm.kv_size import kv_cache_bytes_per_token
    from runlm.models.config import ModelConfig

    c = ModelConfig.from_gguf(GGUFFile(path))
    return kv_cache_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, dtype)


# ---- the parent ------------------------------------------------------------------------------------------------

def mean_kl(reference, other, rows: int = 128) -> float:
    """Mean over positions of KL(P_reference || P_other), in nats (runlm.models.evaluate.mean_kl), a few rows at a
    time so that no [positions, vocab] table is ever whole in memory."""
    import numpy as np
    import torch

    from runlm.models.evaluate import mean_kl as rows_kl

    total = 0.0
    for i in range(0, reference.shape[0], rows):
        r, o = (torch.from_numpy(np.array(a[i:i + rows])) for a in (reference, other))
        total += rows_kl(r, o) * r.shape[0]
    return total / reference.shape[0]


def measure_kl(path: Path, positions: int) -> dict:
    import numpy as np

    ids = text_ids(path, positions)
    with tempfile.TemporaryDirectory() as tmp:
        for child in ("runlm-logits", "llamacpp-logits"):
            subprocess.run([sys.executable, __file__, "--child", child, "--model", str(path), "--ids", json.dumps(ids),
                            "--out", tmp], check=True)
        load = lambda name: np.load(Path(tmp) / f"{name}.npy", mmap_mode="r")  # noqa: E731
        top1 = lambda a, b: float((load(a).argmax(-1) == load(b).argmax(-1)).mean())  # noqa: E731
        return {"positions": positions,
                "runlm fp16 vs fp32": mean_kl(load("runlm-fp32"), load("runlm-fp16")),
                "runlm q8_0 vs fp32": mean_kl(load("runlm-fp32"), load("runlm-q8_0")),
                "llama.cpp q8_0 vs f16": mean_kl(load("llamacpp-f16"), load("llamacpp-q8_0")),
                "runlm fp16 top1 agreement": top1("runlm-fp32", "runlm-fp16"),
                "runlm q8_0 top1 agreement": top1("runlm-fp32", "runlm-q8_0"),
                "llama.cpp top1 agreement (vs f16)": top1("llamacpp-f16", "llamacpp-q8_0")}


def kv_bytes(path: Path, tokens: int) -> dict:
    from runlm.formats.gguf import GGUFFile
    from runlm.models.config import ModelConfig
    from runlm.native.kv_cache import allocate

    c = ModelConfig.from_gguf(GGUFFile(path))
    sizes = {}
    for dtype in DTYPES:
        caches = [allocate(dtype, tokens, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)]
        sizes[dtype] = sum(k.nbytes + v.nbytes for k, v in caches)
    return {"tokens": tokens, **{f"{d} MiB": sizes[d] / 2**20 for d in DTYPES},
            "fp16 / fp32": sizes["fp16"] / sizes["fp32"], "q8_0 / fp32": sizes["q8_0"] / sizes["fp32"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 or a GGUF path")
    ap.add_argument("--positions", type=int, default=1536, help="KL positions in one context (0 skips KL)")
    ap.add_argument("--kv-context", type=int, default=8192)
    ap.add_argument("--context", type=int, default=4096, help="the decode measurement's prompt (0 skips it)")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None,
                    help="the decode children's threads (default: the engine's; on a machine others load, 1 keeps "
                         "OpenMP's waits from dominating)")
    ap.add_argument("--child", choices=["runlm-logits", "llamacpp-logits", "decode"])
    ap.add_argument("--ids")
    ap.add_argument("--out")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    path = model_path(args.model)
    if args.child == "runlm-logits":
        return child_runlm_logits(path, json.loads(args.ids), Path(args.out))
    if args.child == "llamacpp-logits":
        return child_llamacpp_logits(path, json.loads(args.ids), Path(args.out))
    if args.child == "decode":
        print(json.dumps(child_decode(path, args.dtype, args.context, args.gen, args.threads)))
        return None
    print(f"{path.name}; the machine's load is whatever else runs on it (report ratios)", flush=True)
    print("KV bytes:", json.dumps(kv_bytes(path, args.kv_context)), flush=True)
    if args.positions:
        print("KL:", json.dumps(measure_kl(path, args.positions)), flush=True)
    if args.context:
        speeds: dict[str, list[float]] = {d: [] for d in DTYPES}
        for _ in range(args.rounds):
            for dtype in speeds:
                out = subprocess.run([sys.executable, __file__, "--child", "decode", "--model", str(path), "--dtype",
                                      dtype, "--context", str(args.context), "--gen", str(args.gen),
                                      *(["--threads", str(args.threads)] if args.threads else [])],
                                     capture_output=True, text=True, check=True)
                speeds[dtype].append(json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"])
                print(f"  {dtype}: {speeds[dtype][-1]:.1f} tok/s", flush=True)
        best = {d: max(v) for d, v in speeds.items()}
        print(f"decode at {args.context} context, tok/s (best of {args.rounds}): fp32 {best['fp32']:.1f}, "
              f"fp16 {best['fp16']:.1f} ({best['fp16'] / best['fp32']:.2f}x), q8_0 {best['q8_0']:.1f} "
              f"({best['q8_0'] / best['fp32']:.2f}x); all: {json.dumps(speeds)}")
    return None


if __name__ == "__main__":
    main()

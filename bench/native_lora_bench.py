"""What a LoRA adapter costs one stream on the native runner: greedy decode tokens/s of a request run with a
random rank-16 adapter on every module (q/k/v/o/gate/up/down) against the same request on the base model,
on one engine (``enable_lora=True``, ``max_num_seqs=1``), alternating the two over ``--rounds``.

The issue's target: a LoRA request decodes at >= 0.9x the base model's speed. Files are quant_bench's keys
(smollm2's shipped Q4_1 file; the 0.5B-shape model as q8_0, q4_k_m, q4_0). The adapter is written as a PEFT
directory from the file's shapes (no base model needed), cached under .cache/bench-models/lora.

    .venv/bin/python bench/native_lora_bench.py [--files smollm2,q4_k_m] [--rank 16] [--rounds 3] [--threads 1]

Each storage type of ``--dtypes`` (f32: the torch path's bits; f16: half the bytes) is one copy of the adapter
on the same engine. On a shared machine, ``--threads 1`` and the CPU-time figures are the steadier ones.

Writes bench/results/native_lora_bench.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_adapter(path: Path, rank: int) -> Path:
    """A random PEFT adapter (every module, rank ``rank``, alpha 2 * rank) shaped for the GGUF at ``path``."""
    from safetensors.numpy import save_file

    from bench.models import CACHE
    from runlm.formats.gguf import GGUFFile
    from runlm.models.config import ModelConfig

    target = CACHE / "lora" / f"{path.stem}-r{rank}"
    if (target / "adapter_model.safetensors").is_file():
        return target
    c = ModelConfig.from_gguf(GGUFFile(path))
    q, kv, h, inner = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inner), "mlp.up_proj": (h, inner),
              "mlp.down_proj": (inner, h)}
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(c.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            name = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * 0.02).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * 0.02).astype(np.float32)
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    (target / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [m.split(".")[1] for m in shapes]}))
    return target


def decode_speed(engine, ids: list[int], tokens: int, lora) -> tuple[float, float]:
    """Decode tokens/s of one greedy request (the first token, the prompt's, not counted): by the wall clock,
    and by this process's CPU time (steadier on a shared machine; with --threads 1 it is the step's own)."""
    from runlm.engine.core.detokenizer import DELTA
    from runlm.engine.types.sampling_params import SamplingParams

    engine.reset_prefix_cache()
    engine.add_request("r", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                                      ignore_eos=True),
                       output_kind=DELTA, lora_request=lora)
    times: list[tuple[float, float]] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            times += [(time.perf_counter(), time.process_time())] * len(out.outputs[0].token_ids)
    n = len(times) - 1
    return n / (times[-1][0] - times[0][0]), n / (times[-1][1] - times[0][1])


def bench_file(key: str, args: argparse.Namespace) -> list[dict]:
    from bench.quant_bench import model_file, prompt_ids
    from runlm.engine.llm import LLM
    from runlm.engine.types.lora_request import LoRARequest
    from runlm.models import native_lora

    path = model_file(key)
    adapter = str(write_adapter(path, args.rank))
    dtypes = args.dtypes.split(",")
    llm = LLM(str(path), max_num_seqs=1, threads=args.threads, max_model_len=1024, enable_lora=True,
              max_loras=1, max_lora_rank=args.rank, max_cpu_loras=len(dtypes))
    engine = llm.engine
    loras = {}
    for i, dtype in enumerate(dtypes):  # one copy of the adapter per storage type, on one engine
        native_lora.HALF = dtype == "f16"
        loras[dtype] = LoRARequest(f"bench-{dtype}", i + 1, adapter)
        llm.add_lora(loras[dtype])
    ids = prompt_ids(path, args.prompt)
    for lora in loras.values():
        decode_speed(engine, ids, 4, lora)  # warm: the scratch grown
    base: list[tuple[float, float]] = []
    adapted: dict[str, list[tuple[float, float]]] = {d: [] for d in dtypes}
    for _ in range(args.rounds):  # alternating, to spread the machine's noise over all of them
        base.append(decode_speed(engine, ids, args.tokens, None))
        for dtype, lora in loras.items():
            adapted[dtype].append(decode_speed(engine, ids, args.tokens, lora))
    results = []
    for dtype, runs in adapted.items():
        result = {"file": path.name, "runner": "native" if engine.native else "torch", "rank": args.rank,
                  "dtype": dtype}
        for i, clock in enumerate(("wall", "cpu")):
            b, a = statistics.median(x[i] for x in base), statistics.median(x[i] for x in runs)
            result[clock] = {"base_tok_s": round(b, 1), "lora_tok_s": round(a, 1), "ratio": round(a / b, 3),
                             "base_all": [round(x[i], 1) for x in base], "lora_all": [round(x[i], 1) for x in runs]}
        results.append(result)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", default="smollm2,q4_k_m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtypes", default="f32,f16", help="the adapter's storage on the native runner, each measured")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    results = [r for key in args.files.split(",") for r in bench_file(key, args)]
    for r in results:
        for clock in ("wall", "cpu"):
            c = r[clock]
            print(f"{r['file']:34s} {r['runner']:6s} {clock:4s} base {c['base_tok_s']:7.1f} tok/s  LoRA r{r['rank']} "
                  f"{r['dtype']} {c['lora_tok_s']:7.1f} tok/s  ratio {c['ratio']:.3f}")
    out = ROOT / "bench" / "results" / "native_lora_bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

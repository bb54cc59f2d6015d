"""Quantized linear kernels per type and shape: the fast mode's kernel (runlm's block GEMM for the
32-value block types, ggml's vec_dot for the rest) against ggml's vec_dot for every type, runlm's
int8-block kernel (exact mode's ``linear_q8``: weights dequantized in registers, fp32 activations)
and the fp32 kernel, weights streamed from DRAM (enough copies to overflow the last-level cache).

    .venv/bin/python bench/quant_gemm_bench.py [--types Q4_0 Q8_0 Q4_K Q6_K] [--m 1 8 64] [--threads 2] [--shapes 1.5b]

us per call (median of passes); "bytes/w" is what each kernel reads per weight. "native us" is the torch-free
runner's linear layer on the same weights (its plan made once: Q4_K and Q6_K repacked at load, csrc/kquant_packed.h).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf import GGMLQuantizationType as T  # noqa: E402

from runlm.formats.gguf import block_parts  # noqa: E402
from runlm.kernels import ggml, linear, linear_q8  # noqa: E402
from runlm.native import kernels as nk  # noqa: E402

SHAPES = {  # (layer, N, K) of Qwen2.5's layers
    "0.5b": [("qkv", 1152, 896), ("gate_up", 9728, 896), ("down", 896, 4864)],
    "1.5b": [("qkv", 2048, 1536), ("o", 1536, 1536), ("gate_up", 17920, 1536), ("down", 1536, 8960)],
    "3b": [("qkv", 2560, 2048), ("gate_up", 22016, 2048), ("down", 2048, 11008)],
}
POOL_BYTES = 192 << 20


def per_call(fn, copies: int, min_time: float = 0.3) -> float:
    for i in range(min(2, copies)):
        fn(i)
    rounds, start = [], time.perf_counter()
    while len(rounds) < 3 or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        for i in range(copies):
            fn(i)
        rounds.append((time.perf_counter() - t0) / copies)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0", "Q4_1", "Q4_K", "Q6_K"])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", choices=list(SHAPES), default="0.5b", help="whose layer shapes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not ggml.available():
        sys.exit("ggml kernels unavailable")
    print(f"ggml CPU features: {ggml.cpu_features()}; {args.threads} threads\n")
    if nk.available():
        nk.set_threads(args.threads)
    print(f"{'type':5} {'layer':8} {'M':>4} | {'fast us':>8} {'native':>8} {'vec_dot':>8} {'int8 us':>8} "
          f"{'fp32 us':>8} | {'bytes/w':>8}")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name in args.types:
            qtype = T[name]
            for layer, n, k in SHAPES[args.shapes]:
                if k % ggml.block_size(qtype):
                    continue  # llama.cpp's quantizer picks another type for such rows
                dense = torch.randn(n, k, generator=g) * k ** -0.5
                raw = ggml.quantize(dense, qtype)
                copies = max(2, POOL_BYTES // (n * k * 4))
                raws = [raw.clone() for _ in range(copies)]
                fp32 = [dense.clone() for _ in range(max(2, copies // 4))]
                parts = None
                if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
                    q, d, m = (torch.from_numpy(a) for a in block_parts(raw.numpy(), name, (n, k)))
                    parts = [(q.clone(), d.clone(), m.clone()) for _ in range(max(2, copies // 2))]
                native = [nk.LinearWeights([r.numpy()], [qtype], k) for r in raws] if nk.available() else None
                for m_rows in args.m:
                    x = torch.randn(m_rows, k, generator=g)
                    t_fast = per_call(lambda i: ggml.linear(x, [raws[i]], [qtype]), len(raws))
                    t_vec_dot = per_call(lambda i: ggml.module().linear_vec_dot(x, [raws[i]], [qtype]), len(raws))
                    t_fp32 = per_call(lambda i: linear(x, fp32[i]), len(fp32))
                    xn, out = x.numpy(), np.empty((m_rows, n), np.float32)
                    t_native = (per_call(lambda i: nk.linear(xn, native[i], out), len(native)) if native
                                else float("nan"))
                    t_int8 = per_call(lambda i: linear_q8(x, *parts[i]), len(parts)) if parts else float("nan")
                    print(f"{name:5} {layer:8} {m_rows:4d} | {t_fast * 1e6:8.0f} {t_native * 1e6:8.0f} "
                          f"{t_vec_dot * 1e6:8.0f} {t_int8 * 1e6:8.0f} {t_fp32 * 1e6:8.0f} | "
                          f"{raw.numel() / (n * k):8.3f}", flush=True)


if __name__ == "__main__":
    main()

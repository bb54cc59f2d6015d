"""Paged attention on a GPU, one layer, the candidates of issue 28: runlm's Triton unified kernel
(runlm/kernels/triton/attention.py) vs torch flex_attention with a paged block mask vs SDPA per sequence (today's
torch path: a gather and an SDPA call per sequence).

    .venv/bin/python bench/gpu_attention_bench.py                  # Qwen2.5-1.5B's attention shape, bf16
    .venv/bin/python bench/gpu_attention_bench.py --heads 28 --kv-heads 4 --json out.json

Per batch size (1/8/64/256 sequences) and mode -- decode (1 new token over --decode-context positions) and prefill
(--prefill-len new tokens from position 0) -- it prints microseconds per layer call (median of CUDA-event timed
runs): Triton eager (host launch included) and replayed from a CUDA graph (how the GPU runner calls it), for decode
also split-KV (16 segments, graphed; the backend's choice below 128 sequences x KV heads), the KV store kernel, the
bandwidth the graphed attention reaches on K/V bytes, flex_attention's call and the block mask it must rebuild
every step from the block tables, and the SDPA loop. "max |d|" is the Triton output against the SDPA loop. Without
CUDA it says so and exits 0. The cache is freshly allocated: each sequence's blocks are contiguous
(flex_attention's best case; the Triton kernel does not care).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCHES = [1, 8, 64, 256]


def cuda_time_us(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


class Step:
    """One layer's paged cache and a step of ``batch`` sequences, each ``q_len`` new tokens at the end of
    ``context`` positions."""

    def __init__(self, batch: int, q_len: int, context: int, heads: int, kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, dev: str = "cuda") -> None:
        self.batch, self.q_len, self.context, self.block_size = batch, q_len, context, block_size
        per_seq = (context + block_size - 1) // block_size
        num_blocks = batch * per_seq
        self.k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=dev, dtype=dtype)
        self.v_cache = torch.randn_like(self.k_cache)
        self.table = torch.arange(num_blocks, device=dev, dtype=torch.int32).view(batch, per_seq)
        self.q = torch.randn(batch * q_len, heads, head_dim, device=dev, dtype=dtype)
        self.k_new = torch.randn(batch * q_len, kv_heads, head_dim, device=dev, dtype=dtype)
        self.v_new = torch.randn_like(self.k_new)
        self.cu = torch.arange(0, batch * q_len + 1, q_len, device=dev, dtype=torch.int32)
        self.lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
        pos = torch.arange(context - q_len, context, device=dev)
        self.slots = (self.table[:, pos // block_size].long() * block_size + pos % block_size).reshape(-1)
        self.scale = head_dim ** -0.5
        self.out = torch.empty_like(self.q)

    def kv_bytes(self) -> int:
        return 2 * self.batch * self.context * self.k_cache[0, 0].numel() * self.k_cache.element_size()

    def triton(self, segments: int = 1, rows: int = 16) -> torch.Tensor:
        from runlm.kernels.triton.attention import paged_attention
        return paged_attention(self.q, self.k_cache, self.v_cache, self.table, self.cu, self.lens, self.scale,
                               num_seqs=self.batch, out=self.out, num_segments=segments, block_rows=rows)

    def store(self) -> None:
        from runlm.kernels.triton.kv_store import store_kv
        store_kv(self.k_new, self.v_new, self.k_cache, self.v_cache, self.slots)

    def sdpa_loop(self) -> torch.Tensor:
        """Today's torch path, minus its dtype copies: gather each sequence's context, SDPA with a causal mask."""
        k_flat = self.k_cache.view(-1, *self.k_cache.shape[2:])
        v_flat = self.v_cache.view(-1, *self.v_cache.shape[2:])
        pos = torch.arange(self.context, device=self.q.device)
        out = torch.empty_like(self.q)
        mask = None
        if self.q_len > 1:
            mask = pos[None, :] <= torch.arange(self.context - self.q_len, self.context, device=self.q.device)[:, None]
        for b in range(self.batch):
            slots = self.table[b, pos // self.block_size].long() * self.block_size + pos % self.block_size
            ks, vs = k_flat[slots].transpose(0, 1), v_flat[slots].transpose(0, 1)
            rows = slice(b * self.q_len, (b + 1) * self.q_len)
            o = F.scaled_dot_product_attention(self.q[rows].transpose(0, 1), ks, vs, attn_mask=mask,
                                               scale=self.scale, enable_gqa=True)
            out[rows] = o.transpose(0, 1)
        return out


class Flex:
    """flex_attention over the whole cache as one [1, KVH, slots, D] sequence; a mask_mod maps a physical slot to
    its sequence and logical position (from the block tables), so the block mask is rebuilt every step."""

    def __init__(self, step: Step, compile: bool = True) -> None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        self.step = step
        self.flex = torch.compile(flex_attention, dynamic=False) if compile else flex_attention
        self.create_block_mask = create_block_mask
        num_blocks, dev = step.k_cache.shape[0], step.k_cache.device
        self.block_owner = torch.empty(num_blocks, dtype=torch.int32, device=dev)
        self.block_logical = torch.empty(num_blocks, dtype=torch.int32, device=dev)
        for b in range(step.batch):
            self.block_owner[step.table[b].long()] = b
            self.block_logical[step.table[b].long()] = torch.arange(step.table.shape[1], device=dev,
                                                                    dtype=torch.int32)
        self.q_seq = torch.arange(step.batch, device=dev).repeat_interleave(step.q_len)
        self.q_pos = (torch.arange(step.q_len, device=dev) + step.context - step.q_len).repeat(step.batch)
        self.compile = compile
        self.k = step.k_cache.view(-1, *step.k_cache.shape[2:]).transpose(0, 1)[None]  # [1, KVH, slots, D]
        self.v = step.v_cache.view(-1, *step.v_cache.shape[2:]).transpose(0, 1)[None]
        self.q = step.q.transpose(0, 1)[None]
        self.mask = self.block_mask()

    def block_mask(self):
        owner, logical, q_seq, q_pos, bs = (self.block_owner, self.block_logical, self.q_seq, self.q_pos,
                                            self.step.block_size)

        def mask_mod(b, h, q_idx, kv_idx):
            page = kv_idx // bs
            return (owner[page] == q_seq[q_idx]) & (logical[page] * bs + kv_idx % bs <= q_pos[q_idx])

        return self.create_block_mask(mask_mod, None, None, self.q.shape[2], self.k.shape[2],
                                      device=self.q.device, _compile=self.compile)

    def call(self) -> torch.Tensor:
        out = self.flex(self.q, self.k, self.v, block_mask=self.mask, scale=self.step.scale, enable_gqa=True)
        return out[0].transpose(0, 1)


def measure(step: Step, skip_sdpa_over: int, flex: bool = True) -> dict[str, object]:
    row: dict[str, object] = {}
    out = step.triton().clone()  # the calls below write the same buffer
    row["triton_us"] = cuda_time_us(step.triton)
    row["triton_graph_us"] = cuda_time_us(graphed(step.triton))
    if step.q_len == 1:
        split = step.triton(16).clone()
        row["split_graph_us"] = cuda_time_us(graphed(lambda: step.triton(16)))
        row["split_max_d"] = (split.float() - out.float()).abs().max().item()
    else:
        row["rows64_graph_us"] = cuda_time_us(graphed(lambda: step.triton(rows=64)))
    row["kv_GBps"] = step.kv_bytes() / (row["triton_graph_us"] * 1e-6) / 1e9  # type: ignore[operator]
    try:
        if flex:
            candidate = Flex(step)
            row["flex_us"] = cuda_time_us(candidate.call)
            row["flex_mask_us"] = cuda_time_us(candidate.block_mask, reps=5, warmup=1)
            row["flex_max_d"] = (candidate.call().float() - out.float()).abs().max().item()
    except Exception as e:  # noqa: BLE001 - a candidate that fails is a finding, not a crash
        row["flex_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    if step.batch * step.q_len <= skip_sdpa_over:
        row["sdpa_loop_us"] = cuda_time_us(step.sdpa_loop, reps=5, warmup=1)
        row["max_d"] = (step.sdpa_loop().float() - out.float()).abs().max().item()
    # last: the timed store writes the step's K/V over the cache every comparison above reads (timed before it,
    # a prefill's max_d compared the kernel's output with attention over the overwritten rows: 5.6)
    row["store_us"] = cuda_time_us(graphed(step.store))
    return row


def fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if v < 1 else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
    return str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--prefill-len", type=int, default=128)
    ap.add_argument("--skip-sdpa-over", type=int, default=8192, help="no SDPA loop over this many new tokens")
    ap.add_argument("--no-flex", action="store_true", help="skip flex_attention (it compiles per shape: minutes)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_attention_bench: no CUDA device; skipped")
        return 0
    dtype = getattr(torch, args.dtype)
    for knob in ("cache_size_limit", "recompile_limit"):  # flex_attention compiles once per shape
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, H={args.heads} KVH={args.kv_heads} "
          f"D={args.head_dim} block={args.block_size} {args.dtype}; microseconds per layer call\n")
    cols = ["triton_us", "triton_graph_us", "split_graph_us", "rows64_graph_us", "store_us", "kv_GBps", "flex_us",
            "flex_mask_us", "sdpa_loop_us", "max_d", "split_max_d", "flex_max_d"]
    print("| seqs | mode | new tok | context | " + " | ".join(cols) + " |")
    print("|" + "---|" * (4 + len(cols)))
    rows = []
    for mode, q_len, context in [("decode", 1, args.decode_context), ("prefill", args.prefill_len,
                                                                      args.prefill_len)]:
        for batch in args.batches:
            step = Step(batch, q_len, context, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype)
            row = {"seqs": batch, "mode": mode, "q_len": q_len, "context": context,
                   **measure(step, args.skip_sdpa_over, not args.no_flex)}
            rows.append(row)
            print(f"| {batch} | {mode} | {q_len * batch} | {context} | "
                  + " | ".join(fmt(row.get(c)) for c in cols) + " |", flush=True)
            if "flex_error" in row:
                print(f"<!-- flex_attention failed: {row['flex_error']} -->")
            del step
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

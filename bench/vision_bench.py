"""Vision benchmark: time from request to first token with one image in the chat, and decode speed after it,
runlm's server (``runlm serve-engine TEXT.gguf --mmproj MMPROJ.gguf``) vs llama.cpp's own multimodal path
(``llama-server --mmproj``, built from the llama-cpp-python sdist by bench/llama_server.py), on the same text
GGUF + mmproj, the same threads, in one run.

The model is bench/vlm_model.py's random-weight SmolVLM-256M-shaped Idefics3 (SigLIP tower of 12 layers,
hidden 768, 512-pixel tiles of 16-pixel patches; SmolLM2-135M's decoder), both GGUFs f16. SmolVLM's
processor scales an image to a longest edge of 2048 and cuts it into 512-pixel tiles plus a global one, so
a 448x448 picture becomes 16 + 1 tiles and a 1024x768 one 12 + 1 (64 image tokens each): the tower's work,
not the decoder's, is most of the time to first token.

Each request is an OpenAI streaming chat completion, the image as a ``data:`` URL, greedy, a fixed number of
output tokens (end of sequence ignored); every request has a picture of its own (no encoder or prompt cache
helps). Each server first answers one untimed image request (its one-time set-up; that request's time to first
token is kept in the JSON as ``first_request``). The servers take turns, request by request, and never run at once.

    .venv/bin/python bench/vision_bench.py [--rounds 2] [--warmup 1] [--threads 2] [--output-len 32]
        [--peers runlm llama-server] [--llama-server PATH]

Writes bench/results/vision_bench.json and bench/results/vision_bench.md; prints the table with runlm /
llama-server ratios. A peer that cannot serve the model (runlm before its GGUF + mmproj path is in) gets its
error in the JSON and "-" in the table.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.serve_bench import Server, free_port  # noqa: E402
from bench.vlm_model import bench_vlm  # noqa: E402

SIZES = ((448, 448), (1024, 768))
PEERS = ("runlm", "llama-server")
PROMPT = "Describe this image."


def picture(width: int, height: int, seed: int) -> bytes:
    """A PNG with structure (gradients, a block, noise), different for every seed."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // (width - 1), y * 255 // (height - 1), (x + y + seed * 37) % 256], -1).astype(np.int16)
    pixels += rng.integers(-24, 24, size=pixels.shape)
    pixels[height // 4: height // 2, width // 3: width // 2] = rng.integers(0, 255, 3)
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB").save(out, format="PNG")
    return out.getvalue()


def llama_server_binary(given: str | None) -> Path:
    """--llama-server, else a build cached beside this checkout's or RUNLM_SDIST_CACHE's sdist, else a new build."""
    from importlib.metadata import version

    if given:
        return Path(given)
    v = version("llama-cpp-python")
    caches = [ROOT / ".cache"] + ([Path(os.environ["RUNLM_SDIST_CACHE"]).parent]
                                  if os.environ.get("RUNLM_SDIST_CACHE") else [])
    for cache in caches:
        binary = cache / "llama-server" / v / "bin" / "llama-server"
        if binary.is_file():
            return binary
    from bench.llama_server import llama_server

    return llama_server()


def server(name: str, text: Path, mmproj: Path, threads: int, ctx: int, binary: str | None = None) -> Server:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if name == "runlm":
        return Server(name, [sys.executable, "-m", "runlm.cli", "serve-engine", str(text), "--mmproj", str(mmproj),
                             "--port", str(port), "--served-model-name", "bench", "--max-model-len", str(ctx),
                             "--threads", str(threads), "--log-level", "warning"], url, env)
    return Server(name, [str(llama_server_binary(binary)), "-m", str(text), "--mmproj", str(mmproj),
                         "--port", str(port), "--host", "127.0.0.1", "-a", "bench", "-np", "1", "-c", str(ctx),
                         "-t", str(threads), "-tb", str(threads), "--no-warmup"], url, env)


def one_request(url: str, png: bytes, output_len: int) -> dict:
    """Seconds to the first streamed token, decode tokens/s after it, and the prompt's token count."""
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    body = {"model": "bench", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
            "max_tokens": output_len, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                                      {"type": "text", "text": PROMPT}]}]}
    usage: dict = {}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=1800) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    if first is None:
        raise RuntimeError("no token came back")
    n = int(usage.get("completion_tokens") or output_len)
    return {"ttft_s": first - t0, "decode_tok_s": (n - 1) / (end - first) if end > first else float("nan"),
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": n}


def summarise(runs: list[dict]) -> dict:
    return {"ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "prompt_tokens": runs[0]["prompt_tokens"], "runs": runs}


def table(results: dict, peers: list[str]) -> str:
    others = [p for p in peers if p != "runlm"]
    head = ["image", "metric", *peers, *(f"runlm / {p}" for p in others if "runlm" in peers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in results["sizes"]:
        at = results["by_size"][size]
        for key, label in (("ttft_s", "time to first token, s (lower is better)"),
                           ("decode_tok_s", "decode tok/s after it"), ("prompt_tokens", "prompt tokens")):
            cells = [size, label]
            for p in peers:
                v = at.get(p, {}).get(key)
                cells.append("-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v))
            for p in others if "runlm" in peers else ():
                a, b = at.get("runlm", {}).get(key), at.get(p, {}).get(key)
                cells.append(f"{a / b:.2f}" if isinstance(a, int | float) and isinstance(b, int | float) and b
                             and key != "prompt_tokens" else "-")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _last_line(error: str) -> str:
    lines = [line for line in error.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="requests per image size and peer (medians reported)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=1, help="untimed image requests per peer before the rounds")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="a llama-server binary built with mtmd "
                    "(default: bench/llama_server.py's cached build, built if absent)")
    args = ap.parse_args()

    _, text, mmproj = bench_vlm()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    meta = {"model": "random-weight SmolVLM-256M-shaped Idefics3 (f16 text GGUF + f16 mmproj)",
            "text_gguf": text.name, "mmproj": mmproj.name, "threads": args.threads, "output_len": args.output_len,
            "rounds": args.rounds, "cpu": cpu_name(), "cores": os.cpu_count(),
            "cpu_features": [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_int8", "amx_bf16") if f in flags]}
    servers, errors = {}, {}
    for name in args.peers:
        s = server(name, text, mmproj, args.threads, args.ctx, args.llama_server)
        try:
            s.start(timeout=600)
            servers[name] = s
        except Exception as exc:  # (runlm before its GGUF + mmproj path lands: reported, not fatal)
            errors[name] = f"did not start: {str(exc)[-1500:]}"
            s.stop()
    runs: dict[str, dict[str, list[dict]]] = {}
    first: dict[str, dict] = {}
    try:
        for name, s in servers.items():  # one untimed image first: what a server does once (lazy set-up, caches)
            for i in range(args.warmup):
                try:
                    first.setdefault(name, one_request(s.url, picture(*SIZES[0], 1000 + i), args.output_len))
                except Exception as exc:
                    errors[name] = f"warm-up: {type(exc).__name__}: {str(exc)[:1500]}"
                    break
            if name in first:
                print(f"{name} warm-up: ttft {first[name]['ttft_s']:.2f} s", flush=True)
        for w, h in SIZES:
            size = f"{w}x{h}"
            for r in range(args.rounds):
                for name, s in servers.items():  # turns, request by request
                    if name in errors:
                        continue
                    seed = hash((w, h, r)) & 0xFFFF  # the same pictures for both peers; new ones every round
                    try:
                        result = one_request(s.url, picture(w, h, seed), args.output_len)
                    except Exception as exc:
                        errors[name] = f"{size}: {type(exc).__name__}: {str(exc)[:1500]}"
                        continue
                    runs.setdefault(size, {}).setdefault(name, []).append(result)
                    print(f"{size} {name} round {r}: ttft {result['ttft_s']:.2f} s, decode "
                          f"{result['decode_tok_s']:.1f} tok/s, {result['prompt_tokens']} prompt tokens", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    sizes = [f"{w}x{h}" for w, h in SIZES]
    results = {"meta": meta, "sizes": sizes, "errors": errors, "first_request": first,
               "by_size": {size: {p: summarise(rs) for p, rs in runs.get(size, {}).items()} for size in sizes}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vision_bench.json").write_text(json.dumps(results, indent=1))
    md = (f"# Vision benchmark ({meta['model']}; {args.threads} threads each, {meta['cpu']}, {meta['cores']} cores; "
          f"{args.output_len} output tokens, median of {args.rounds})\n\n{table(results, args.peers)}\n")
    if first:
        md += ("\nFirst image request of each server (the warm-up, 448x448, not in the medians): " +
               ", ".join(f"{p} {r['ttft_s']:.2f} s to the first token" for p, r in first.items()) + "\n")
    if errors:
        md += "\n" + "\n".join(f"- {p}: {_last_line(e)}" for p, e in errors.items()) + "\n"
    (out / "vision_bench.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

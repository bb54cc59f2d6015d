"""/metrics: every loaded backend's Prometheus metrics, each sample labelled with its model."""
from __future__ import annotations

import asyncio
import re

from runlm.runner.loader import Loader
from runlm.runner.runner import Runner

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(.*)")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def label_samples(text: str, labels: dict[str, str], seen_meta: set[str]) -> list[str]:
    extra = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            key = " ".join(parts[:3])
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and key not in seen_meta:
                seen_meta.add(key)
                out.append(line)
            continue
        m = _SAMPLE.fullmatch(line.strip())
        if not m:
            continue
        name, existing, value = m.groups()
        inner = existing[1:-1] if existing else ""
        out.append(f"{name}{{{extra}{',' if inner else ''}{inner}}} {value}")
    return out


async def _scrape(runner: Runner) -> str:
    try:
        resp = await runner.client.get("/metrics", timeout=5.0)
        return resp.text if resp.status_code == 200 else ""
    except Exception:  # a backend that is going away contributes nothing this time
        return ""


async def aggregate(loader: Loader) -> str:
    runners = [r for r in loader.runners.values() if r.ready]
    texts = await asyncio.gather(*(_scrape(r) for r in runners))
    used = loader.used()
    lines = [
        "# HELP runlm_runner_loaded_models Models loaded in backend processes.",
        "# TYPE runlm_runner_loaded_models gauge",
        f"runlm_runner_loaded_models {len(loader.runners)}",
        "# HELP runlm_runner_memory_reserved_bytes Memory reserved for loaded models (estimates).",
        "# TYPE runlm_runner_memory_reserved_bytes gauge",
        f'runlm_runner_memory_reserved_bytes{{kind="ram"}} {used.ram}',
        f'runlm_runner_memory_reserved_bytes{{kind="vram"}} {used.vram}',
        "# HELP runlm_runner_memory_budget_bytes The runner's memory budget.",
        "# TYPE runlm_runner_memory_budget_bytes gauge",
        f"runlm_runner_memory_budget_bytes {loader.budget.ram}",
    ]
    seen: set[str] = set()
    for runner, text in zip(runners, texts):
        lines += label_samples(text, {"model": runner.model_ref, "backend": runner.backend.name,
                                      "mode": runner.mode.value}, seen)
    return "\n".join(lines) + "\n"

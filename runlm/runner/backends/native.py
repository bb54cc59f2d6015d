"""runlm's own engine as a backend: ``runlm serve-engine`` in a child process on a Unix socket."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from runlm import __version__
from runlm.kv_size import KV_CACHE_DTYPES, NATIVE_AUTO
from runlm.runner.backends.base import STATUS_RUNNING, RequiredMemory, format_status
from runlm.runner.backends.flags import is_float, is_int, is_size
from runlm.runner.backends.process import ProcessBackend
from runlm.runner.config import BackendConfig, BackendMode
from runlm.sizes import available_memory, gpu_memory, parse_size
from runlm.store.modelfile_model import model_files

if TYPE_CHECKING:
    from runlm.store import StoredModel

# what a Python process with torch, tokenizers and the HTTP server takes before any weights
RUNTIME_OVERHEAD = 400 << 20
# KV cache reserved per model: room for this many sequences at the full context
KV_SEQUENCES = 2
MIN_KV_BYTES = 16 << 20
# the largest adapter rank a configured model accepts unless --max-lora-rank says otherwise
LORA_RANK = 64
BYTES_PER_WEIGHT = 4  # float32: what weights are dequantized to on load, unless kept as int8 blocks


def weight_bytes(model: StoredModel) -> int:
    """Weights in memory (the engine's default, fast mode): matrices as stored in the file, which the
    engine maps and computes on without a copy; float32 for the rest (norms, F32 matrices, and every
    weight of an embedding model, which is dequantized)."""
    info = model.info
    if "completion" not in info.capabilities:
        return int(info.parameters * BYTES_PER_WEIGHT)
    return int(info.stored_matrix_bytes + (info.parameters - info.stored_matrix_params) * BYTES_PER_WEIGHT)


def kv_cache_bytes(model: StoredModel, context: int, config: BackendConfig | None = None) -> int:
    """K/V for KV_SEQUENCES full-context sequences (fp16 for a GGUF model, which the native runner serves; fp32 for
    others, which it may not); with a draft model, the draft's K/V too (the engine keeps it in the same blocks and
    splits the cache by both models' bytes per token)."""
    if "completion" not in model.info.capabilities:
        return MIN_KV_BYTES
    per_token = model.info.kv_cache_bytes_per_token(estimated_kv_dtype(model, config))
    if config is not None and config.speculative is not None:
        per_token += config.speculative.draft_kv_bytes_per_token
    return max(per_token * context * KV_SEQUENCES, MIN_KV_BYTES)


def estimated_kv_dtype(model: StoredModel, config: BackendConfig | None) -> str:
    """The KV cache dtype a memory estimate counts: the runtime flag's, else fp16 for a GGUF model (the native
    runner's own), else "auto" (fp32: another model may run on torch)."""
    dtype = kv_cache_dtype(config) if config is not None else "auto"
    return NATIVE_AUTO if dtype == "auto" and model.info.format == "gguf" else dtype


def kv_cache_dtype(config: BackendConfig) -> str:
    """The KV cache's storage a --kv-cache-dtype runtime flag asks for ("auto" without one: the runner's choice)."""
    value = flag_value(config.runtime_flags, "--kv-cache-dtype") or "auto"
    return value if value in KV_CACHE_DTYPES else "auto"


def flag_value(flags: list[str], name: str) -> str | None:
    """The value of the last ``name`` in flags ('--f v' or '--f=v'): the one argparse keeps."""
    found = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            found = flags[i + 1]
        elif flag.startswith(name + "="):
            found = flag.partition("=")[2]
    return found


def runtime_kv_bytes(config: BackendConfig) -> int | None:
    """The KV cache a --kv-cache-memory runtime flag sets, read as serve-engine reads it (a number up to 1 is a
    fraction of the memory free now); None without the flag."""
    value = flag_value(config.runtime_flags, "--kv-cache-memory")
    if value is None:
        return None
    try:
        fraction = float(value)
    except ValueError:
        return parse_size(value)
    return int(available_memory() * fraction) if 0 < fraction <= 1 else parse_size(value)


def projector_bytes(model: StoredModel) -> int:
    """A multimodal projector's tower in memory: float32, from a file of (mostly) 16-bit weights."""
    return sum(f["size"] for f in model.manifest["files"] if f["path"] == model.mmproj) * 2


def draft_bytes(config: BackendConfig) -> int:
    """The draft model's file(s), mapped as stored, for speculative decoding (0 without a draft)."""
    spec = config.speculative
    if spec is None or not spec.draft_model_path:
        return 0
    path = Path(spec.draft_model_path)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return path.stat().st_size if path.is_file() else 0


def speculative_argv(config: BackendConfig) -> list[str]:
    """Model Runner's ``speculative`` object as serve-engine's --speculative-config (vLLM's flag)."""
    spec = config.speculative
    if spec is None or not spec.draft_model_path:
        return []
    value: dict[str, object] = {"model": spec.draft_model_path, "num_speculative_tokens": spec.num_tokens}
    if spec.min_acceptance_rate > 0:  # 0 is Model Runner's "unset": the engine's default applies
        value["min_acceptance_rate"] = spec.min_acceptance_rate
    return ["--speculative-config", json.dumps(value)]


def on_gpu(config: BackendConfig, gpu_total: int | None = None) -> int | None:
    """The GPU memory a model run with these runtime flags reserves (its --gpu-memory-utilization share, 0.9 by
    default), or None where it runs on the CPU (--device cpu, or auto without a GPU). ``gpu_total``: the
    device's memory (default: asked of the driver)."""
    device = flag_value(config.runtime_flags, "--device") or "auto"
    total = gpu_total if gpu_total is not None else gpu_memory()
    if device == "cpu" or total is None:
        return None
    share = float(flag_value(config.runtime_flags, "--gpu-memory-utilization") or 0.9)
    return int(total * share)


def offloaded_bytes(model: StoredModel, config: BackendConfig, gpu: int, context: int) -> int:
    """The memory a GPU run's layer offload keeps on the host (runlm.models.offload): with --n-gpu-layers K, the
    weights of the layers before the last K and their K/V for ``context`` tokens; without it, what of the weights
    its GPU share cannot hold (the engine then splits the model so)."""
    weights = weight_bytes(model)
    value, layers = flag_value(config.runtime_flags, "--n-gpu-layers"), model.info.num_layers
    if value is None:
        return max(0, weights - gpu)
    on_gpu_layers = int(value)
    if on_gpu_layers == -1 or not layers or on_gpu_layers >= layers:
        return 0
    return (weights + kv_cache_bytes(model, context, config)) * (layers - on_gpu_layers) // layers


def template_file(socket: str) -> Path:
    """Where a runner's configured chat template is written: beside its socket, in the daemon's own folder."""
    return Path(socket + ".template")


class NativeBackend(ProcessBackend):
    name = "native"
    supports_speculative = True
    allowed_flags = {"--max-num-seqs": is_int, "--max-num-batched-tokens": is_int, "--threads": is_int,
                     "--kv-cache-memory": is_size,
                     "--kv-cache-dtype": lambda v: v in KV_CACHE_DTYPES,
                     "--device": lambda v: v in ("cpu", "cuda", "auto") or v.startswith("cuda:") and v[5:].isdigit(),
                     "--dtype": lambda v: v in ("float32", "bfloat16", "float16"),
                     "--gpu-memory-utilization": lambda v: is_float(v) and 0 < float(v) <= 1,
                     "--enforce-eager": None, "--context-shift": None,
                     "--async-scheduling": None, "--no-async-scheduling": None,
                     "--limit-mm-per-prompt": lambda v: re.fullmatch(r"(image=)?\d{1,4}", v) is not None,
                     "--allowed-media-domains": lambda v: re.fullmatch(r"(\*\.)?[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*", v)
                     is not None and len(v) <= 253,
                     "--max-loras": is_int, "--max-lora-rank": is_int, "--max-cpu-loras": is_int,
                     "--tensor-parallel-size": lambda v: is_int(v) and 1 <= int(v) <= 64,
                     "--n-gpu-layers": lambda v: re.fullmatch(r"-1|[1-9]\d{0,3}", v) is not None}
    supports_lora = True
    takes_chat_template = True

    async def install(self) -> None:
        return None  # it is runlm itself

    def status(self) -> str:
        return format_status(STATUS_RUNNING, f"runlm {__version__}")

    def disk_usage(self) -> int:
        return 0

    def kv_cache_dtype(self, config: BackendConfig) -> str | None:
        return kv_cache_dtype(config)

    def required_memory(self, model: StoredModel, config: BackendConfig) -> RequiredMemory:
        gpu = on_gpu(config)
        if gpu is not None:  # the engine takes its share of the GPU (weights, activations, then the KV cache)
            host = offloaded_bytes(model, config, gpu, self.context_size(model, config))  # (layer offload's)
            return RequiredMemory(ram=RUNTIME_OVERHEAD + projector_bytes(model) + host, vram=gpu)
        weights = weight_bytes(model) + draft_bytes(config) + projector_bytes(model)
        kv = runtime_kv_bytes(config) or kv_cache_bytes(model, self.context_size(model, config), config)
        return RequiredMemory(ram=weights + kv + RUNTIME_OVERHEAD, vram=0)

    def command(self, socket: str, model: str, model_ref: str, stored: StoredModel | None,
                config: BackendConfig) -> list[str]:
        argv = [sys.executable, "-m", "runlm.cli", "serve-engine", model, "--uds", socket,
                "--served-model-name", model_ref]
        if stored is not None:
            projector = stored.projector_path(model)
            if projector is not None:  # the store's file beside the GGUF, never a path a request names
                argv += ["--mmproj", str(projector)]
            context = self.context_size(stored, config)
            argv += ["--max-model-len", str(context)]
            if on_gpu(config) is None:  # on a GPU, --gpu-memory-utilization and a profiled step size the cache
                argv += ["--kv-cache-memory", str(kv_cache_bytes(stored, context, config))]
            if stored.info.sampling:  # what the store knows the model recommends (the built-in catalogue's too)
                argv += ["--override-generation-config", json.dumps(stored.info.sampling)]
            template, defaults, adapter = model_files(stored, Path(model))  # a model made from a Modelfile
            if config.chat_template is not None:  # a configured template, over the Modelfile's and the model's
                template = template_file(socket)
            argv += ["--chat-template-file", str(template)] if template else []
            argv += ["--model-defaults-file", str(defaults)] if defaults else []
            # its ADAPTER: a LoRA named as the model itself is, so every request for the model runs with it
            loras = {**({model_ref: str(adapter)} if adapter else {}), **config.lora_paths}
        else:
            loras = dict(config.lora_paths)
        if loras:  # every configured adapter may run in one step; a runtime flag may say otherwise
            argv += ["--enable-lora", "--max-loras", str(len(loras)), "--max-lora-rank", str(LORA_RANK),
                     "--lora-modules", *[f"{n}={p}" for n, p in loras.items()]]
        if flag_value(config.runtime_flags, "--device") is None:
            argv += ["--device", "auto"]  # a GPU where there is one
        return argv + speculative_argv(config) + self.check_flags(config.runtime_flags)

    async def run(self, socket: str, model: str, model_ref: str, mode: BackendMode, config: BackendConfig,
                  stored: StoredModel | None = None) -> None:
        if config.chat_template is not None:  # its text beside the socket, for --chat-template-file
            fd = os.open(template_file(socket), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(config.chat_template)
        await self.run_process(self.command(socket, model, model_ref, stored, config), socket,
                               f"native-{model_ref.replace('/', '_').replace(':', '_')}-{mode.value}", config.gpu)

"""torch.profiler around an engine core (vLLM's ``start_profile`` / ``stop_profile``).

The profiler records the ops of the thread that starts it, so it must be started and stopped on the
thread that steps the engine (AsyncLLM's engine thread, LLM's caller). The model's own kernels are
not all aten ops, so while a trace is being taken the model's forward is wrapped in a
``record_function`` named ``runlm::forward <ModelClass>`` through module hooks (removed on stop):
the trace shows each forward and the ops under it. One Chrome trace JSON per engine (one per replica
with data parallelism), named after the process and the moment it stopped.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when a trace starts: an LLM holds a profiler whether or not it ever profiles
    import torch
    from torch.profiler import profile

__all__ = ["PROFILER_DIR_ENV", "EngineProfiler", "ProfilerError", "profiler_dir"]

PROFILER_DIR_ENV = "RUNLM_TORCH_PROFILER_DIR"  # like vLLM's VLLM_TORCH_PROFILER_DIR


class ProfilerError(RuntimeError):
    """Profiling is not set up (no directory), or start/stop was called out of turn."""


def profiler_dir(configured: str | os.PathLike | None) -> Path:
    """Where traces go: the configured directory, else $RUNLM_TORCH_PROFILER_DIR; an error if neither."""
    where = configured or os.environ.get(PROFILER_DIR_ENV)
    if not where:
        raise ProfilerError(f"profiling needs a directory: profiler_dir=..., --profiler-dir or ${PROFILER_DIR_ENV}")
    return Path(where)


class EngineProfiler:
    """One trace at a time over one engine core; ``stop()`` writes it and returns its path."""

    def __init__(self, directory: str | os.PathLike | None, name: str = "engine") -> None:
        self.directory, self.name = directory, name
        self._prof: profile | None = None
        self._hooks: list[Any] = []

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self, engine: Any) -> None:
        if self._prof is not None:
            raise ProfilerError("a profile is already being taken; stop it first")
        where = profiler_dir(self.directory)
        where.mkdir(parents=True, exist_ok=True)
        import torch
        from torch.profiler import ProfilerActivity, profile

        self._hook_forward(engine)
        self._prof = profile(activities=[ProfilerActivity.CPU]
                             + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else []),
                             record_shapes=True)
        self._prof.start()

    def stop(self) -> str:
        prof, self._prof = self._prof, None
        if prof is None:
            raise ProfilerError("no profile is being taken; start one first")
        prof.stop()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        path = profiler_dir(self.directory) / f"{self.name}-{os.getpid()}-{time.time_ns()}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        return str(path)

    def _hook_forward(self, engine: Any) -> None:
        import torch
        from torch.profiler import record_function

        model = getattr(getattr(engine, "loaded", None), "model", None)
        if not isinstance(model, torch.nn.Module):
            return
        label = f"runlm::forward {type(model).__name__}"
        open_spans: list[Any] = []

        def before(module: torch.nn.Module, args: Any) -> None:
            span = record_function(label)
            span.__enter__()
            open_spans.append(span)

        def after(module: torch.nn.Module, args: Any, output: Any) -> None:
            if open_spans:
                open_spans.pop().__exit__(None, None, None)

        self._hooks = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]

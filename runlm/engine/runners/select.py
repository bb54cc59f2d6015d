"""Which runner runs a model: one function over the runners, in a fixed preference (tensor-parallel where more
than one rank is asked for, then GPU, native CPU, torch).

Each runner kind answers "can you run this spec with this config, and if not, why" (``why_not``); the first that
can runs it, and the reasons of those before it are what the engine's start-up line prints. A kind that does not
apply to the config at all (the GPU runner on a CPU) is skipped without a reason; one that applies but refuses
something it will not fall back on (the GPU runner asked for LoRA) raises a ValueError naming it. Adding a runner
is a kind in its own package and a row in RUNNERS: the engine knows runners only through this interface, and
nothing here imports torch (a kind imports its runner when it loads).
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from runlm.engine.types.config import EngineConfig
from runlm.models.spec import ModelSpec

if TYPE_CHECKING:
    from runlm.engine.core.kv_groups import AnyBlockManager
    from runlm.engine.structured.backend import StructuredOutputManager

log = logging.getLogger("runlm.engine")

# (module, kind) in order of preference
RUNNERS = (("runlm.engine.runners.tp_kind", "GPU_TP"),
           ("runlm.engine.runners.tp_kind", "TP"),
           ("runlm.engine.runners.gpu_kind", "GPU"),
           ("runlm.engine.runners.native", "NATIVE"),
           ("runlm.engine.runners.torch_kind", "TORCH"))


class RunnerKind(Protocol):
    name: str
    torch_free: bool  # whether the process computes without torch
    kv_cache_dtypes: tuple[str, ...]  # the KV cache types it holds ("auto": the compute dtype)

    def applies(self, config: EngineConfig) -> bool:
        """Whether the config asks for this kind of runner at all (a device, a switch)."""
        ...

    def why_not(self, spec: ModelSpec, config: EngineConfig) -> str | None:
        """Why it cannot run this model so (None: it can); raises ValueError for what it refuses outright."""
        ...

    def load(self, spec: ModelSpec, config: EngineConfig) -> Any:
        """The model's weights as this runner computes on them (LoadedModel, NativeLoaded)."""
        ...

    def build(self, config: EngineConfig, loaded: Any, blocks: AnyBlockManager,
              structured: StructuredOutputManager) -> Any:
        """The model runner (its ``execute(SchedulerOutput)`` computes a step)."""
        ...

    def kv_cache_blocks(self, config: EngineConfig, loaded: Any, bytes_per_token: int, max_model_len: int) -> int:
        ...

    def set_threads(self, n: int, loaded: Any) -> None:
        ...


@dataclass(frozen=True, slots=True)
class RunnerChoice:
    kind: RunnerKind
    reasons: tuple[str, ...]  # why each runner preferred to it does not run the model

    def describe(self) -> str:
        """For the start-up line: 'native', or 'torch (exact numerics)' -- the first reason where there is one."""
        return f"{self.kind.name} ({self.reasons[0]})" if self.reasons else self.kind.name


def runner_kinds() -> list[RunnerKind]:
    return [getattr(importlib.import_module(module), name) for module, name in RUNNERS]


def select_runner(spec: ModelSpec, config: EngineConfig) -> RunnerChoice:
    """The first runner that runs ``spec`` under ``config``, and why those before it do not."""
    reasons: list[str] = []
    for kind in runner_kinds():
        if not kind.applies(config):
            continue
        reason = kind.why_not(spec, config)
        if reason is None:
            if config.kv_cache_dtype not in kind.kv_cache_dtypes:
                holders = [k for k in runner_kinds() if config.kv_cache_dtype in k.kv_cache_dtypes]
                names = " or ".join(k.name for k in holders)
                if not any(k.applies(config) for k in holders):  # (fp8: the GPU runner's, and this is no GPU run)
                    why = f"which runs on a GPU (--device cuda), not on {config.device}"
                else:
                    why = f"which does not run this model ({reasons[0] if reasons else kind.name + ' runs it'})"
                raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype!r} needs the {names} runner, {why}; use "
                                 f"kv_cache_dtype 'auto' (--kv-cache-dtype auto)")
            return RunnerChoice(kind, tuple(reasons))
        log.info("%s runner not used for %s: %s", kind.name, spec.path.name, reason)
        reasons.append(reason)
    raise ValueError(f"no runner runs {spec.path.name}: {'; '.join(reasons)}")

"""What every engine core shares: the surface AsyncLLM and LLM drive, and the control plane
(sleep / wake, prefix-cache reset, statistics) written once for generation and pooling alike.

An engine core is synchronous and single-threaded: ``add_request`` checks and queues, ``step``
schedules and runs one batch, ``abort_request`` ends requests now. LLMEngine (generation) and
PoolingEngine (embeddings, scores) subclass ``EngineCore`` and supply the model-specific parts:
what a request looks like, what a step computes, and how weights are dropped and reloaded.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from runlm.engine.core.kv_groups import AnyBlockManager
from runlm.engine.core.lora_manager import LoRAError, LoRAManager, LoRARequest
from runlm.engine.core.scheduler import Scheduler
from runlm.engine.runners.threads import set_native_threads, set_torch_threads
from runlm.engine.types.config import EngineConfig, physical_cores
from runlm.engine.types.errors import PromptError
from runlm.engine.types.outputs import PoolingRequestOutput, RequestOutput
from runlm.engine.types.pooling_params import PoolingParams
from runlm.engine.types.sampling_params import SamplingParams
from runlm.formats.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from runlm.engine.spec_decode.decoder import SpecDecodeStats

# what a step hands out: text for generation, a vector or score for pooling
EngineOutput = RequestOutput | PoolingRequestOutput
# either kind of params reaches either engine, which refuses the other kind with TaskError
RequestParams = SamplingParams | PoolingParams

log = logging.getLogger("runlm.engine")


def kernel_kinds(device: str) -> list[str]:
    """The kernels a torch engine on ``device`` computes with, for its start line. Only that device's are asked:
    on a GPU the CPU kernels are never compiled or loaded (their first use builds them: half a minute)."""
    import torch

    if torch.device(device).type != "cpu":
        from runlm.kernels import triton as rtriton

        return ["triton (paged attention, GGUF blocks)"] if rtriton.available() else []
    from runlm import kernels
    from runlm.kernels import fused, ggml

    return [name for name, ok in (("ggml blocks", ggml.available()), ("linear", kernels.available()),
                                  ("attention", kernels.attention_available()), ("fused", fused.available())) if ok]


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding: drafts and acceptance
    num_generation_tokens: int = 0  # tokens generated since start (each replica's own, under data parallel)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class EngineCore:
    """The base of LLMEngine and PoolingEngine. Subclasses set the attributes below in ``__init__``
    and implement add_request, abort_request, step, ``_drop(level)`` and ``_reload()``."""

    # whether the block manager stands for real KV tensors (pooling uses it for admission only)
    holds_kv_cache: ClassVar[bool] = True

    config: EngineConfig
    device: torch.device
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    blocks: AnyBlockManager
    scheduler: Scheduler
    requests: dict[str, Any]
    sleep_level: int = 0
    num_preemptions: int = 0
    num_generation_tokens: int = 0
    lora: LoRAManager | None = None  # set where LoRA is enabled (generation engines only)

    def _set_threads(self) -> None:
        """How many threads the kernels use; the loader applies it to whichever computes (torch or native)."""
        self.threads = self.config.threads or physical_cores()

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        raise NotImplementedError

    @property
    def max_num_seqs(self) -> int:
        """Sequences the engine runs at once (the server bounds waiting work beyond this)."""
        return self.config.max_num_seqs

    threads: int
    native: bool = False  # whether the native runner computes (no torch in the process)
    runner_desc = "torch"  # which runner computes, and why not one preferred to it (the start-up line)

    def set_threads(self, n: int) -> None:
        """The kernels' CPU threads from now on."""
        self.threads = n
        (set_native_threads if self.native else set_torch_threads)(n)

    def log_start(self, kv_bytes: int) -> None:
        """One line at start: what memory the cache holds and which kernels compute (why it is fast or not)."""
        if self.native:
            from runlm.native import kernels as native

            kinds = [f"native ({native.cpu_features() or 'no SIMD'}; no torch)"]
            threads = native.get_threads()
        else:
            import torch

            kinds = kernel_kinds(str(self.config.device))
            threads = torch.get_num_threads()
        log.info("engine ready: %s; runner %s; max_model_len %d; KV cache %d blocks x %d tokens (%.1f MiB, %s); "
                 "%s numerics; kernels: %s; %d threads", type(self).__name__, self.runner_desc, self.max_model_len,
                 len(self.blocks.blocks), self.blocks.block_size, kv_bytes / (1 << 20),
                 self.config.kv_cache_dtype if self.config.kv_cache_dtype != "auto" else
                 str(self.config.dtype).removeprefix("torch."),
                 "exact" if self.config.exact_numerics else "fast", ", ".join(kinds) or "torch fallback", threads)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Any, params: RequestParams | None = None, priority: int = 0,
                    arrival_time: float | None = None, output_kind: str = "cumulative",
                    lora_request: LoRARequest | None = None) -> None:
        """Check the request (raising runlm.engine.types.errors' typed errors) and queue it."""
        raise NotImplementedError

    def abort_request(self, request_ids: str | list[str]) -> Sequence[EngineOutput]:
        """End requests now and free their blocks; returns their final outputs."""
        raise NotImplementedError

    def step(self) -> Sequence[EngineOutput]:
        raise NotImplementedError

    def take_failures(self) -> list[tuple[str, Exception]]:
        """Requests a step dropped since last asked (a step that ran out of memory), each with its caller's error."""
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_token_ids(self, ids: list[int], what: str) -> None:
        """A prompt (or pooling input) must have tokens, each in the vocabulary."""
        if not ids:
            raise PromptError(f"the {what} is empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise PromptError(f"token id {bad} in the {what} is outside the vocabulary (size {self.vocab_size})")

    def check_awake(self) -> None:
        if self.sleep_level:
            raise RuntimeError("the engine is asleep; call wake_up() first")

    # ---- LoRA adapters (vLLM's names) ---------------------------------------------------------
    def lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise LoRAError("LoRA adapters are not enabled for this engine; start it with enable_lora=True "
                            "(--enable-lora) on a model that generates text")
        return self.lora

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (requests naming one that is not loaded load it themselves)."""
        return self.lora_manager().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; requests already running with it finish with it."""
        return self.lora_manager().remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.lora_manager().ids() if self.lora is not None else set()

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep an adapter loaded however many others are loaded after it (until removed)."""
        return self.lora_manager().pin(lora_int_id)

    # ---- control --------------------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()

    @property
    def modalities(self) -> tuple[str, ...]:
        """What a prompt may hold: ("text",), or ("text", "image") for a vision-language model."""
        return ("text",)

    def reset_mm_cache(self) -> None:
        """Forget the images' embeddings (nothing to forget for a text-only model)."""

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def check_alive(self) -> None:
        """Raises RuntimeError where a process the engine computes with is gone (a tensor-parallel rank): cheap,
        from any thread, so health checks see it while the engine is idle."""

    def sleep(self, level: int = 1) -> None:
        """Give memory back while idle. 1: drop the KV cache; 2: also drop the weights (reloaded on wake)."""
        if level not in (1, 2):
            raise ValueError("sleep level must be 1 or 2")
        if self.has_unfinished_requests():
            raise RuntimeError("cannot sleep with requests in flight; pause or drain first")
        self._drop(level)
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        if self.sleep_level:
            self._reload(self.sleep_level)
        self.sleep_level = 0

    def _drop(self, level: int) -> None:
        raise NotImplementedError

    def _reload(self, level: int) -> None:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        s = self.scheduler
        if not self.holds_kv_cache:
            return EngineStats(len(s.running), len(s.waiting), 0.0, 0, 0, 0)
        return EngineStats(len(s.running), len(s.waiting), self.blocks.usage, self.blocks.stats.queries,
                           self.blocks.stats.hits, self.num_preemptions, self.spec_decode_stats(),
                           self.num_generation_tokens)

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's counters, where the engine speculates."""
        return None

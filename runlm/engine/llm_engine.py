"""The synchronous engine core for generation: add requests, step, collect outputs. LLM and AsyncLLM
drive it.

One step is: schedule -> run the model and sample (ModelRunner) -> process the sampled tokens
(detokenize, stops, finish) -> outputs.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from runlm.engine.core.detokenizer import CUMULATIVE, RequestState, append_token, make_output, new_request_state
from runlm.engine.core.encoder_cache import EncoderCache
from runlm.engine.core.kv_groups import block_manager
from runlm.engine.core.lora_manager import LoRAManager, LoRARequest, lora_salt
from runlm.engine.core.mm_prompt import prompt_images
from runlm.engine.core.overlap import drop_pending, mark_pending, overlap_safe
from runlm.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from runlm.engine.core.sequence import Sequence
from runlm.engine.core.thinking import ThinkingTracker
from runlm.engine.engine_core import EngineCore, log
from runlm.engine.runners.select import select_runner
from runlm.engine.sample.sampler import SampledToken, make_generator
from runlm.engine.spec_decode.decoder import SpecDecodeStats, spec_decoder
from runlm.engine.spec_decode.draft import configured_draft, draft_kv_bytes_per_token
from runlm.engine.structured.backend import StructuredOutputManager
from runlm.engine.types.config import EngineConfig, dtype_itemsize, state_slots
from runlm.engine.types.errors import PromptError, PromptTooLongError, StepOutOfMemoryError, TaskError
from runlm.engine.types.outputs import RequestOutput
from runlm.engine.types.pooling_params import PoolingParams
from runlm.engine.types.sampling_params import SamplingParams
from runlm.kv_size import NATIVE_AUTO, kv_cache_bytes_per_token
from runlm.models.spec import ModelSpec, read_spec
from runlm.sizes import return_free_heap

if TYPE_CHECKING:
    from runlm.engine.runners.gpu_sampler import SampleLaunch
    from runlm.models.vision import VisionModel

PromptType = str | Mapping[str, Any] | list[int]
POSITION_BLOCKS = 1 << 16  # the most blocks of an engine whose model keeps no K/V


class LLMEngine(EngineCore):
    def __init__(self, config: EngineConfig, spec: ModelSpec | None = None) -> None:
        self.config = config
        self._set_threads()
        spec = spec or read_spec(config.model, config.mmproj)
        self.choice = select_runner(spec, config)  # which runner computes, and why not the ones before it
        self.native, self.runner_desc = self.choice.kind.torch_free, self.choice.describe()
        if config.kv_cache_dtype == "auto" and self.native:  # the native runner's own choice: fp16 rows
            self.config = config = replace(config, kv_cache_dtype=NATIVE_AUTO)
        self.loaded = self._load(spec)
        # before the cache is allocated: its untouched pages would otherwise land on the load's freed, resident ones
        return_free_heap()
        self.tokenizer = self.loaded.tokenizer
        self.vision: VisionModel | None = self.loaded.vision
        self.encoder_cache = EncoderCache()
        mc = self.loaded.config
        self.vocab_size = mc.vocab_size
        self.max_model_len = mc.context_length(config.max_model_len)
        heads, k_dim, v_dim = mc.kv_cache_shape
        if mc.recurrent_layers and config.speculative_config is not None:
            raise ValueError(f"speculative_config: the {mc.family} family's recurrent layers keep one state per "
                             "sequence, which cannot take back rejected draft tokens; serve it without speculative "
                             "decoding")
        self.kv_bytes_per_token = per_token = kv_cache_bytes_per_token(
            len(mc.kv_layers), heads, k_dim, config.kv_cache_dtype, dtype_itemsize(config.dtype), v_dim)
        draft = configured_draft(config, self.loaded, self.threads)  # speculative decoding's draft model, if any
        per_token += draft_kv_bytes_per_token(draft, config)  # its K/V lives in the same blocks
        if per_token:
            num_blocks = self.choice.kind.kv_cache_blocks(config, self.loaded, per_token, self.max_model_len)
        else:  # no layer keeps K/V (Mamba2): the blocks only count positions, every sequence at full length (or
            # POSITION_BLOCKS' worth in all: a million-token context times max_num_seqs would be millions of blocks)
            num_blocks = min(config.max_num_seqs * -(-self.max_model_len // config.block_size), POSITION_BLOCKS)
        # sliding-window layers give back the blocks behind their window as sequences run
        # recurrent layers' states: one per running sequence, as many as the same budget holds
        states = state_slots(config, mc.state_bytes_per_seq) if mc.recurrent_layers else 0
        self.blocks = block_manager(mc, num_blocks, config.block_size, config.enable_prefix_caching,
                                    config.max_num_seqs, config.max_num_batched_tokens, states)
        window = self.blocks.window
        # no sequence may outgrow the whole cache: preempted, it could never be readmitted (one whose
        # blocks behind the window are given back only ever holds about a window's worth)
        capacity = len(self.blocks.blocks) * config.block_size
        fits_window = window is not None and window + 2 * config.block_size <= capacity
        self.max_seq_tokens = self.max_model_len if fits_window else min(self.max_model_len, capacity)
        self.scheduler = Scheduler(SchedulerConfig(self.max_model_len, config.max_num_seqs,
                                                   config.max_num_batched_tokens), self.blocks)
        self.eos_ids = frozenset(self.tokenizer.stop_token_ids) | frozenset(mc.eos_token_ids)
        self.structured = StructuredOutputManager(self.tokenizer, mc.vocab_size, self.eos_ids)
        self.runner = self.choice.kind.build(config, self.loaded, self.blocks, self.structured)
        self.runner.encoder_cache = self.encoder_cache
        if config.enable_lora:  # (a tensor-parallel runner's manager also attaches each adapter on every rank)
            manager = getattr(self.runner, "lora_manager", LoRAManager)
            self.lora = manager(self.loaded.model, mc, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
            self.scheduler.max_loras = config.max_loras
        self.spec = spec_decoder(config, draft, self.blocks, self.max_seq_tokens)
        # async scheduling: the runner's step still running, whose sampled sequences hold stand-in tokens
        self.overlap = config.async_scheduling and getattr(self.runner, "overlaps", False) and self.spec is None
        self.inflight: SampleLaunch | None = None
        self.num_overlapped_steps = 0  # steps whose tokens were read while the next step ran
        if self.overlap:
            self.runner_desc += " (async scheduling)"
        self.requests: dict[str, RequestState] = {}
        self.num_preemptions = 0
        self.sleep_level = 0
        self.failures: list[tuple[str, Exception]] = []  # requests a step dropped, and why (take_failures)
        layer_blocks = sum(self.blocks.layer_blocks(i) for i in mc.kv_layers)
        self.log_start(layer_blocks * config.block_size * per_token // max(len(mc.kv_layers), 1)
                       + self.blocks.state_slots * mc.state_bytes_per_seq)

    def _load(self, spec: ModelSpec) -> Any:
        """The chosen runner's model (LoadedModel or NativeLoaded), its threads set."""
        loaded = self.choice.kind.load(spec, self.config)
        self.choice.kind.set_threads(self.threads, loaded)
        return loaded

    # ---- images -----------------------------------------------------------------------------
    @property
    def modalities(self) -> tuple[str, ...]:
        return ("text", "image") if self.vision is not None else ("text",)

    def reset_mm_cache(self) -> None:
        """Forget every image's embeddings (vLLM's name); the prefix cache keeps blocks already computed."""
        self.encoder_cache.reset()

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    # ---- requests -------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, Mapping) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise PromptError("a prompt is a string, a list of token ids or {'prompt_token_ids': [...]}")

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """Everything that makes a prompt unrunnable, raised before it is queued (the one owner of these checks)."""
        if not ids:
            raise PromptError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens, but the model's context length is "
                                     f"{self.max_model_len} tokens; shorten the prompt", len(ids), self.max_model_len)
        self.check_token_ids(ids, "prompt")
        needed = self.blocks.blocks_needed(len(ids) + 1)
        if needed > len(self.blocks.blocks):
            raise PromptError(f"the prompt needs {needed} KV-cache blocks but the cache holds only "
                              f"{len(self.blocks.blocks)}; raise kv_cache_memory (--kv-cache-memory)")
        params.check_vocab(self.vocab_size)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    output_kind: str = CUMULATIVE, lora_request: LoRARequest | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TaskError("this model generates text; embeddings and scores need an embedding or reranking "
                            "model")
        text, ids = self.tokenize_prompt(prompt)
        mm = prompt_images(prompt, ids, self.vision, self.config.image_limit, self.loaded.path.name)
        if mm is not None:
            ids = mm.token_ids
        self.check_prompt(ids, params)
        # an invalid schema fails here, on the engine's thread, before anything is queued
        grammar = self.structured.compile(params)
        lora_key = self.lora_manager().acquire(lora_request, params.n) if lora_request is not None else 0
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seq = Sequence(request_id, i, list(ids), len(ids), params, priority, arrival,
                           generator=make_generator(seed), logprobs=[] if params.logprobs is not None else None,
                           stop_ids=stop_ids, lora_key=lora_key)
            seq.table.salt = lora_salt(lora_key)
            if mm is not None:
                seq.mm = mm
                seq.table.mm_keys = tuple((f.start, f.end, bytes.fromhex(f.hash)) for f in mm.features)
            if params.thinking is not None:
                seq.thinking = ThinkingTracker(params.thinking)
            self.structured.add(seq, grammar)
            seqs.append(seq)
        self.requests[request_id] = new_request_state(request_id, text, ids, seqs, self.tokenizer, output_kind)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests now and free their KV blocks; returns their final outputs."""
        outs = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.requests.get(rid)
            if state is None:
                continue
            for seq in state.seqs:
                drop_pending(seq)  # (a token a running step draws for it: never handed out)
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self._finish(seq)
            out = make_output(state)
            del self.requests[rid]
            if out is not None:
                outs.append(out)
        return outs

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.structured.remove(seq)
        if seq.lora_key and self.lora is not None:
            self.lora.release(seq.lora_key)

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> run (forward + sample) -> process the tokens -> outputs. With async scheduling the step is
        queued and the previous step's tokens are processed while it runs (_step_overlapped)."""
        self.check_awake()
        sched = self._schedule()
        if not sched.seqs:
            return self._outputs(self._resolve())
        if self.overlap:
            return self._step_overlapped(sched)
        scheduled = sched.total_tokens  # (verification takes rejected draft tokens out of it)
        try:
            with self.lora.batch(s.lora_key for s in sched.seqs) if self.lora else nullcontext():
                sampled = self.runner.execute(sched)
        except Exception as exc:
            if not out_of_memory(exc):
                raise
            return self._drop_for_memory(sched, exc)
        if self.spec is not None:
            self.spec.after_verify(sched, sampled)
        self.scheduler.update(sched)
        touched = self._process(sampled)
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.config.max_num_batched_tokens - scheduled)
        return self._outputs(touched)

    def _step_overlapped(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Queue this step (its stand-ins fed from the running step's draws on the device), then process the running
        step's tokens while it computes. This step is left running when nothing in its sampling needs them on the
        host; otherwise it is waited for now (runlm.engine.core.overlap.overlap_safe)."""
        try:
            with self.lora.batch(s.lora_key for s in sched.seqs) if self.lora else nullcontext():
                launch = self.runner.launch(sched, self.inflight)
        except Exception as exc:
            if not out_of_memory(exc):
                raise
            return self._drop_for_memory(sched, exc)
        touched = self._resolve()
        self.scheduler.update(sched)  # (sequences the previous step just finished are skipped)
        constrained = self.structured.seqs
        if launch.tokens is None or not all(overlap_safe(s, constrained) for s in launch.seqs):
            touched.update(self._process(launch.result()))
            return self._outputs(touched)
        outputs = self._outputs(touched)  # (built before this step's stand-ins join the sequences)
        mark_pending(launch.seqs)
        self.inflight = launch
        return outputs

    def _resolve(self) -> dict[str, RequestState]:
        """The running step's tokens, waited for and processed in place of their stand-ins."""
        launch, self.inflight = self.inflight, None
        if launch is None:
            return {}
        sampled = launch.result()
        for s in sampled:
            drop_pending(s.seq)
        self.num_overlapped_steps += 1
        return self._process(sampled)

    def _drop_for_memory(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """A step ran out of memory: nothing of it was kept (a sequence's computed tokens move on only after a step),
        so its requests would run it again. The one that made it big is dropped -- the request with the most of the
        step's tokens, else (a step of decodes) the one with the longest context -- failing with
        StepOutOfMemoryError; the rest run on in the next step (and should that one run out too, its biggest goes)."""
        weight: dict[str, tuple[int, int]] = {}
        for s, n in zip(sched.seqs, sched.num_new_tokens):
            new, context = weight.get(s.request_id, (0, 0))
            weight[s.request_id] = (new + n, max(context, s.num_tokens))
        rid = max(weight, key=lambda r: weight[r])
        log.warning("a step of %d tokens for %d sequences ran out of memory (%s); dropping %s", sched.total_tokens,
                    len(sched.seqs), str(exc).splitlines()[0][:200], rid)
        self.failures.append((rid, StepOutOfMemoryError(
            f"the step computing this request ran out of memory ({weight[rid][0]} of its {sched.total_tokens} tokens "
            f"were this request's); it was dropped so the others could go on: retry it, or lower "
            f"--max-num-batched-tokens")))
        self.abort_request(rid)
        release = getattr(self.runner, "release_memory", None)  # (the GPU runner: the allocator's cached blocks)
        release() if release is not None else return_free_heap()
        return []

    def take_failures(self) -> list[tuple[str, Exception]]:
        """Requests dropped since last asked (request id, the error to give its caller)."""
        failures, self.failures = self.failures, []
        return failures

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        now = time.monotonic()
        for seq in sched.seqs:
            metrics = self.requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        return sched

    def _process(self, sampled: list[SampledToken]) -> dict[str, RequestState]:
        """Append each sampled token: logprobs, text, stop checks; finished sequences free their blocks."""
        touched: dict[str, RequestState] = {}
        for s in sampled:
            seq = s.seq
            if seq.is_finished:  # a speculating sequence stopped before the last of its verified tokens
                continue
            state = self.requests[seq.request_id]
            if s.logprobs is not None and seq.logprobs is not None:  # both exist when logprobs were asked for
                seq.logprobs.append(s.logprobs)
                seq.cumulative_logprob += s.logprobs[s.token].logprob
            reason = append_token(state, seq.index, s.token)
            self.num_generation_tokens += 1
            if reason is None and seq.num_tokens >= self.max_seq_tokens:
                reason = "length"
                if seq.num_tokens < self.max_model_len:
                    log.warning("request %s stopped at %d tokens: the whole KV cache holds %d; raise "
                                "--kv-cache-memory for longer outputs", seq.request_id, seq.num_tokens,
                                self.max_seq_tokens)
            if reason is not None:
                seq.finish_reason = reason
                self._finish(seq)
            touched[state.request_id] = state
        if self.spec is not None:
            for state in touched.values():
                state.metrics.num_draft_tokens = sum(s.spec.num_drafted for s in state.seqs)
                state.metrics.num_accepted_tokens = sum(s.spec.num_accepted for s in state.seqs)
        return touched

    def _outputs(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        """What to hand out now (per the request's output kind); finished requests are forgotten."""
        outputs = []
        for rid, state in touched.items():
            out = make_output(state)
            if out is not None:
                outputs.append(out)
            if state.finished:
                del self.requests[rid]
        return outputs

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        return self.spec.stats if self.spec is not None else None

    def check_alive(self) -> None:
        check = getattr(self.runner, "check_alive", None)  # (the tensor-parallel runner's workers)
        if check is not None:
            check()

    # ---- control: sleep drops what EngineCore.sleep asks, wake_up restores it -----------------
    def _drop(self, level: int) -> None:
        self._resolve()  # (its sequences are all finished: sleep waits for no request)
        if level == 2 and self.config.tensor_parallel_size > 1:
            raise ValueError("sleep level 2 (dropping the weights) is not supported with tensor parallelism: the "
                             "ranks would load them again each in its own process; use level 1")
        self.runner.free_kv_cache()
        draft = self.spec.draft if self.spec is not None else None
        if draft is not None:
            draft.free_kv_cache()
        self.blocks.reset_prefix_cache()
        if level == 2:
            self.loaded.model.release_weights()
            if draft is not None:
                draft.release_weights()

    def _reload(self, level: int) -> None:
        draft = self.spec.draft if self.spec is not None else None
        if level == 2:
            # the file is read again (sleep gave its mapping back); the text model's weights are all that is kept
            self.loaded.model = self._load(read_spec(self.loaded.path, find_projector=False)).model
            if self.lora is not None:
                self.lora.rebind(self.loaded.model)
            if draft is not None:
                draft.reload_weights(self.config)
        self.runner.allocate_kv_cache()
        if draft is not None:
            draft.allocate_kv_cache()


__all__ = ["LLMEngine", "PromptError", "PromptType"]


def out_of_memory(exc: BaseException) -> bool:
    """Whether an error is an allocation that failed: torch's OutOfMemoryError (CUDA), Python's MemoryError, or the
    host allocator's refusal that torch raises as a RuntimeError."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "CUDA out of memory" in text)

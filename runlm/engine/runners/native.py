"""The model runner for NativeModel: the KV cache and activations are numpy arrays, one native call
computes a step's layers, and the numpy sampler picks the tokens. Nothing here imports torch.

The same phases as runlm.engine.runners.torch_runner (prepare -> forward -> prompt logprobs -> logits ->
sample), over the same plan (runlm.engine.core.batch_plan) and sampler, so the two runners differ only
in what computes the forward pass. A vision-language model (a text GGUF + llama.cpp's mmproj) keeps its tower
in torch: a step's image rows (runlm.engine.core.mm_step) come from the encoder cache, or one batched tower
call, and go into the native step as embeddings written over their tokens'. A speculating sequence's 1 + k rows
(its last known token, then the draft) ride in the same native step as every other row and are verified
(runlm.engine.sample.rejection) instead of sampled, as the torch runner does. With LoRA enabled, each step
tells the decoder each row's adapter key (the adapters themselves are runlm.engine.core.lora_manager's).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from runlm.engine.core.batch_plan import BatchPlan, plan_batch
from runlm.engine.core.encoder_cache import EncoderCache
from runlm.engine.core.kv_groups import AnyBlockManager, HybridBlockManager
from runlm.engine.core.mm_step import step_images
from runlm.engine.core.scheduler import SchedulerOutput
from runlm.engine.runners.threads import set_native_threads, set_torch_threads
from runlm.engine.sample.rejection import sample_and_verify, spec_rows
from runlm.engine.sample.sampler import SampledToken, add_prompt_logprobs
from runlm.engine.structured.backend import StructuredOutputManager
from runlm.engine.types.config import EngineConfig, kv_cache_blocks
from runlm.models.native import NativeLoaded, build_native, not_native, why_not_native_gguf
from runlm.models.native_safetensors import build_native_safetensors, why_not_native_spec_dir
from runlm.models.spec import ModelSpec, as_spec
from runlm.models.vision import TEXT_MODEL_NEEDS
from runlm.native import lora as native_lora
from runlm.native.kv_cache import allocate

log = logging.getLogger("runlm.native")


def why_not_native(config: EngineConfig) -> str | None:
    """What the engine asks for that the native runner does not do (None: nothing); the model file's own
    reasons are runlm.models.native.why_not_native's."""
    if os.environ.get("RUNLM_NATIVE_RUNNER", "1") == "0":
        return "RUNLM_NATIVE_RUNNER=0"
    reasons = [(config.exact_numerics, "exact numerics"), (config.device != "cpu", "a device other than cpu"),
               # the native runner computes in float32 over weights as stored (bf16/fp16 safetensors stay half-size);
               # bfloat16 or float16 compute (activations, KV cache) is the torch runner's
               (str(config.dtype).removeprefix("torch.") != "float32",
                f"{str(config.dtype).removeprefix('torch.')} compute (the native runner computes in float32 over "
                f"weights as stored)")]
    return next((what for bad, what in reasons if bad), None)


def why_not_native_model(spec: ModelSpec, config: EngineConfig) -> str | None:
    """Why the native runner does not run ``spec`` under ``config`` (None: it does): the engine's asks first, then
    the model file's, then what its vision tower asks of the text model."""
    reason = why_not_native(config)
    if reason is not None:
        return reason
    reason = why_not_native_gguf(spec) if spec.gguf is not None else why_not_native_spec_dir(spec)
    if reason is None and spec.projector is not None and spec.vision is not None:
        return TEXT_MODEL_NEEDS.get(spec.vision)
    return reason


def load_native_model(spec: ModelSpec, config: EngineConfig) -> NativeLoaded:
    """The model ``why_not_native_model`` accepted, on the native runner (its vision tower, torch's, beside it)."""
    build = build_native if spec.gguf is not None else build_native_safetensors
    loaded = build(spec, config.max_model_len)
    if spec.projector is not None:
        from runlm.models.vision import build_mmproj

        loaded.vision = build_mmproj(spec.projector, loaded.tokenizer)
    return loaded


def native_model(model: ModelSpec | Path, config: EngineConfig, reasons: list[str] | None = None
                 ) -> NativeLoaded | None:
    """The model (a spec or its path) on the native runner, or None (logged, with the reason, which is also
    appended to ``reasons``) where it needs torch."""
    spec = as_spec(model)
    reason = why_not_native_model(spec, config)
    if reason is not None:
        not_native(spec.path, reason, reasons)
        return None
    return load_native_model(spec, config)


class NativeKind:
    """The native CPU runner: C++ kernels on the weights as stored, no torch in the process."""
    name = "native"
    torch_free = True
    kv_cache_dtypes = ("auto", "fp32", "fp16", "q8_0")

    def applies(self, config: EngineConfig) -> bool:
        return True

    def why_not(self, spec: ModelSpec, config: EngineConfig) -> str | None:
        return why_not_native_model(spec, config)

    def load(self, spec: ModelSpec, config: EngineConfig) -> NativeLoaded:
        return load_native_model(spec, config)

    def build(self, config: EngineConfig, loaded: NativeLoaded, blocks: AnyBlockManager,
              structured: StructuredOutputManager) -> NativeRunner:
        return NativeRunner(config, loaded, blocks, structured)

    def kv_cache_blocks(self, config: EngineConfig, loaded: NativeLoaded, bytes_per_token: int,
                        max_model_len: int) -> int:
        return kv_cache_blocks(config, bytes_per_token, max_model_len)

    def set_threads(self, n: int, loaded: NativeLoaded) -> None:
        set_native_threads(n)
        if loaded.vision is not None:
            set_torch_threads(n)  # the vision tower computes in torch


class NativeRunner:
    def __init__(self, config: EngineConfig, loaded: NativeLoaded, blocks: AnyBlockManager,
                 structured: StructuredOutputManager | None = None) -> None:
        self.loaded, self.blocks, self.structured = loaded, blocks, structured
        self.lora = config.enable_lora
        self.kv_cache_dtype = config.kv_cache_dtype
        self.encoder_cache = EncoderCache()  # the engine hands it its own (reset_mm_cache)
        self.kv_caches: list[tuple[np.ndarray, np.ndarray]] = []
        self._hidden = np.empty((0, loaded.config.hidden_size), dtype=np.float32)
        self.allocate_kv_cache()

    def allocate_kv_cache(self) -> None:
        c = self.loaded.config
        self.kv_caches = [allocate(self.kv_cache_dtype, self.blocks.layer_blocks(i) * self.blocks.block_size,
                                   c.num_kv_heads, c.head_dim) for i in range(c.num_layers)]
        self._bind()

    def _bind(self) -> None:
        decoder = self.loaded.model.decoder
        if decoder is not None and self.kv_caches:
            decoder.set_kv_caches(self.kv_caches)
            if isinstance(self.blocks, HybridBlockManager):  # sliding-window layers' K/V in a cache of their own
                decoder.set_layer_groups(self.blocks.layer_group)

    def free_kv_cache(self) -> None:
        self.kv_caches = []

    def rebind(self) -> None:
        """After the weights were loaded again (wake from sleep level 2): point the new decoder at the cache."""
        self._bind()

    def execute(self, sched: SchedulerOutput) -> list[SampledToken]:
        """Compute the scheduled tokens; sample for every sequence whose known tokens are now all computed."""
        plan = plan_batch(sched, self.blocks)
        if self.lora:
            self.set_lora_rows(sched, plan)
        hidden = self.run_model(plan, self.image_rows(sched) if self.loaded.vision is not None else None)
        model = self.loaded.model
        for rows in plan.prompt_logprob_rows:
            add_prompt_logprobs(rows.seq, model.compute_logits(hidden[rows.first_row:rows.first_row + rows.count]),
                                rows.first_pos)
        verify_rows = spec_rows(plan.spec_rows, plan.spec_seqs)
        if not plan.sample_seqs and not verify_rows:
            return []
        raw = model.compute_logits(hidden[plan.sample_rows + verify_rows])
        return sample_and_verify(raw, plan.sample_seqs, plan.spec_seqs, self.structured)

    def set_lora_rows(self, sched: SchedulerOutput, plan: BatchPlan) -> None:
        """Each row's adapter key for this step's forward pass (none at all when no sequence has one)."""
        decoder = self.loaded.model.decoder
        assert decoder is not None, "the model's weights were released (sleep level 2)"
        keys = [s.lora_key for s in sched.seqs]
        native_lora.set_rows(decoder, native_lora.row_keys(keys, plan.query_lens) if any(keys) else None)

    def image_rows(self, sched: SchedulerOutput) -> tuple[np.ndarray, np.ndarray] | None:
        """(batch rows, their input embeddings) for the step's image tokens, as the torch runner splices them:
        the tower runs once over the step's images not in the encoder cache (which keeps numpy rows here)."""
        images = step_images(sched)
        if images is None:
            return None
        if images.bidirectional is not None:
            raise ValueError("the native runner has no bidirectional image attention")
        vision = self.loaded.vision
        embeds = self.encoder_cache.embeddings([f for f, _ in images.parts],
                                               lambda fs: [e.float().numpy() for e in vision.encode(fs)])
        values = np.concatenate([e[idx] for e, (_, idx) in zip(embeds, images.parts)])
        return images.rows, np.ascontiguousarray(values, dtype=np.float32)

    def run_model(self, plan: BatchPlan, embeds: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        decoder = self.loaded.model.decoder
        assert decoder is not None, "the model's weights were released (sleep level 2)"
        t = plan.ids.shape[0]
        if self._hidden.shape[0] < t:
            self._hidden = np.empty((t, self._hidden.shape[1]), dtype=np.float32)
        flat = np.concatenate(plan.context_slots) if len(plan.context_slots) > 1 else plan.context_slots[0]
        groups = None
        if plan.group_slots is not None:  # per KV group after the first, per sequence: (new tokens', context) slots
            groups = (np.stack([np.concatenate([new for new, _ in g]) for g in plan.group_slots]),
                      np.stack([np.concatenate([context for _, context in g]) for g in plan.group_slots]))
        positions = self.loaded.model.rope_positions(plan.positions, plan.query_lens, plan.context_lens)
        return decoder.forward(plan.ids, positions, plan.slot_mapping,
                               np.asarray(plan.query_lens, dtype=np.int64),
                               np.asarray(plan.context_lens, dtype=np.int64), flat, self._hidden[:t], embeds, groups)


NATIVE = NativeKind()

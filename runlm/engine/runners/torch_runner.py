"""Runs one scheduled batch through the model, in named phases (nano-vllm's and mini-sglang's order):

    prepare (flatten the batch into ids, positions and KV slots) -> run_model (the forward pass)
    -> prompt logprobs -> compute_logits -> sample (penalties, grammar masks, the draw, logprobs)

A speculating sequence brings its draft tokens after its last known token; its 1 + k rows are
verified (spec_decode_verify) instead of sampled, in the same forward pass as everything else.

Owns the KV cache tensors (one K and one V tensor per layer, addressed by flat slot =
block * block_size + offset) and turns a SchedulerOutput into the model's forward context.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from runlm.dtypes import torch_dtype
from runlm.engine.core.batch_plan import BatchPlan, PromptLogprobRows, plan_batch
from runlm.engine.core.encoder_cache import EncoderCache
from runlm.engine.core.kv_groups import AnyBlockManager, HybridBlockManager
from runlm.engine.core.mm_step import StepImages, mrope_positions, step_images
from runlm.engine.core.scheduler import SchedulerOutput
from runlm.engine.core.sequence import Sequence
from runlm.engine.sample.rejection import sample_and_verify, spec_rows
from runlm.engine.sample.sampler import SampledToken, add_prompt_logprobs
from runlm.engine.structured.backend import StructuredOutputManager
from runlm.engine.types.config import EngineConfig
from runlm.models.attention import ForwardContext, GroupSlots, forward_context
from runlm.models.config import ModelConfig
from runlm.models.load import LoadedModel
from runlm.models.vision import VisionModel


@dataclass(slots=True)
class PreparedBatch:
    """A step's tokens flattened for one forward pass, and which rows to sample from."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    context: ForwardContext
    sample_rows: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)
    # speculating sequences: the first of their 1 + k rows (the last known token, then the draft tokens)
    spec_rows: list[int] = field(default_factory=list)
    spec_seqs: list[Sequence] = field(default_factory=list)
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, blocks: AnyBlockManager,
                 structured: StructuredOutputManager | None = None) -> None:
        self.loaded, self.blocks, self.structured = loaded, blocks, structured
        self.dtype, self.device = torch_dtype(config.dtype), torch.device(config.device)
        self.encoder_cache = EncoderCache()  # the engine hands it its own (reset_mm_cache)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # recurrent layers' (conv, ssm) states, one row per state slot (runlm.models.mamba2); None for the others
        self.states: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
        self.allocate_kv_cache()

    def allocate_kv_cache(self) -> None:
        self.kv_caches, self.states = allocate_caches(self.loaded.config, self.layer_slots(), self.blocks.state_slots,
                                                      self.kv_cache_heads(), self.dtype, self.device)

    def layer_slots(self) -> list[int]:
        """Each layer's cache slots (0 for a layer that keeps no K/V)."""
        c, bs = self.loaded.config, self.blocks.block_size
        return [self.blocks.layer_blocks(layer) * bs if layer in c.kv_layers else 0 for layer in range(c.num_layers)]

    @property
    def layer_group(self) -> list[int] | None:
        """Each layer's KV group, for a cache in groups (sliding-window layers beside global ones); else None."""
        return self.blocks.layer_group if isinstance(self.blocks, HybridBlockManager) else None

    def kv_cache_heads(self) -> int:
        """The KV heads a layer's cache holds per token (a tensor-parallel rank: its own)."""
        return self.loaded.config.kv_cache_shape[0]

    def free_kv_cache(self) -> None:
        self.kv_caches = []
        self.states = None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[SampledToken]:
        """Compute the scheduled tokens; sample for every sequence whose known tokens are now all computed."""
        batch = self.prepare(sched)
        hidden = self.run_model(batch)
        for rows in batch.prompt_logprob_rows:
            self._prompt_logprobs(rows, hidden)
        verify_rows = spec_rows(batch.spec_rows, batch.spec_seqs)
        if not batch.sample_seqs and not verify_rows:
            return []
        raw = self.loaded.model.compute_logits(hidden[batch.sample_rows + verify_rows]).float().cpu().numpy()
        return sample_and_verify(raw, batch.sample_seqs, batch.spec_seqs, self.structured)

    def prepare(self, sched: SchedulerOutput) -> PreparedBatch:
        return self.prepare_plan(plan_batch(sched, self.blocks), sched)

    def prepare_plan(self, plan: BatchPlan, sched: SchedulerOutput) -> PreparedBatch:
        """The step's plan (runlm.engine.core.batch_plan) as tensors: shared, not copied, and moved to the device."""
        t = self.slot_tensor
        ctx = plan_context(plan, self.kv_caches, self.states, self.layer_group, self.device)
        positions = t(plan.positions)
        vision = self.loaded.vision
        if vision is not None:
            images = step_images(sched)
            if images is not None:
                ctx.mm_embeds = self.image_rows(images, vision)
                ctx.bidirectional = images.bidirectional
            if vision.uses_mrope:
                positions = t(mrope_positions(sched, len(plan.ids)))
        return PreparedBatch(t(plan.ids), positions, ctx, plan.sample_rows, plan.sample_seqs,
                             plan.spec_rows, plan.spec_seqs, plan.prompt_logprob_rows)

    def image_rows(self, images: StepImages, vision: VisionModel) -> tuple[torch.Tensor, torch.Tensor]:
        return image_rows(self.encoder_cache, images, vision, self.device)

    def slot_tensor(self, slots: np.ndarray) -> torch.Tensor:
        """An int64 array (ids, positions, cache slots) as a tensor on the device: shared, not copied, on the CPU."""
        return torch.from_numpy(slots).to(self.device)

    def run_model(self, batch: PreparedBatch) -> torch.Tensor:
        with forward_context(batch.context):
            return self.loaded.model(batch.input_ids, batch.positions)

    def _prompt_logprobs(self, rows: PromptLogprobRows, hidden: torch.Tensor) -> None:
        logits = self.loaded.model.compute_logits(hidden[rows.first_row:rows.first_row + rows.count]).float().cpu()
        add_prompt_logprobs(rows.seq, logits.numpy(), rows.first_pos)


def image_rows(cache: EncoderCache, images: StepImages, vision: VisionModel, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch rows, their embeddings) for the step's image tokens, on ``device``: the tower runs once over the
    images not in the encoder cache."""
    embeds = cache.embeddings([f for f, _ in images.parts], vision.encode)
    values = torch.cat([e[torch.from_numpy(idx).to(e.device)] for e, (_, idx) in zip(embeds, images.parts)])
    return torch.from_numpy(images.rows).to(device), values.to(device)


KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
States = list[tuple[torch.Tensor, torch.Tensor] | None] | None


def allocate_caches(c: ModelConfig, layer_slots: list[int], state_slots: int, kv_heads: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[KVCaches, States]:
    """Per layer a (K, V) cache of ``layer_slots[i]`` slots of ``kv_heads`` heads, and for a model with recurrent
    layers, their (conv, ssm) states, ``state_slots`` rows each."""
    # empty, not zeros: attention reads only slots already written, and untouched pages cost no RAM
    _, k_dim, v_dim = c.kv_cache_shape  # (latent attention: one latent row per token, no V)
    kv_caches = [(torch.empty((slots, kv_heads, k_dim), dtype=dtype, device=device),
                  torch.empty((slots, kv_heads, v_dim), dtype=dtype, device=device)) for slots in layer_slots]
    return kv_caches, allocate_states(c, state_slots, device)


def allocate_states(c: ModelConfig, state_slots: int, device: torch.device) -> States:
    """A model's recurrent layers' (conv, ssm) states, float32, ``state_slots`` rows each (None for the other
    layers; None for a model without recurrent layers)."""
    if not c.recurrent_layers:
        return None
    # (a sequence's first tokens start its state from zero: nothing need be cleared)
    recurrent, (conv, ssm) = set(c.recurrent_layers), c.state_shapes
    return [(torch.empty((state_slots, *conv), device=device), torch.empty((state_slots, *ssm), device=device))
            if layer in recurrent else None for layer in range(c.num_layers)]


def plan_context(plan: BatchPlan, kv_caches: KVCaches, states: States, layer_group: list[int] | None,
                 device: torch.device) -> ForwardContext:
    """The forward context of a step's plan over these caches (a tensor-parallel rank's own, for one)."""
    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    ctx = ForwardContext(plan.query_lens, plan.context_lens, t(plan.slot_mapping), [t(c) for c in plan.context_slots],
                         kv_caches)
    if states is not None:
        ctx.states, ctx.state_slots, ctx.state_fresh = states, plan.state_slots, plan.state_fresh
    if plan.group_slots is not None:
        assert layer_group is not None
        ctx.layer_group = layer_group
        ctx.groups = [GroupSlots(torch.cat([t(new) for new, _ in group]), [t(c) for _, c in group])
                      for group in plan.group_slots]
    return ctx

"""The GPU runner: the torch runner's phases (prepare -> run_model -> prompt logprobs -> logits -> sample) with
the host out of the decode loop.

- Step inputs live in persistent device buffers sized for max_num_batched_tokens / max_num_seqs: the step's
  metadata (ids, positions, slot mapping, cu_seqlens_q, seq_lens, block tables) is packed into one pinned host
  array (runlm.engine.runners.gpu_graphs.pack_step) and uploaded by ONE host->device copy, then spread on the
  device into the model's input buffers and the attention backend's.
- Attention is the runner's own AttentionBackend (ForwardContext.backend): every layer stores K/V in a paged
  cache and attends over block tables in one call (runlm.kernels.triton.backend.PagedAttentionBackend: its
  Triton kernels on CUDA or under TRITON_INTERPRET=1, else its torch reference, the same arithmetic as
  runlm.models.attention).
- CUDA graphs, captured at start-up for padded decode batch sizes (gpu_graphs.graph_batch_sizes) unless
  ``enforce_eager`` or the backend reads the host (its reference path): a decode-only step pads to the next size and
  replays; prefill and mixed steps run eagerly.
- Sampling on the device (gpu_sampler), one host sync per step.

On a CPU (RUNLM_GPU_RUNNER=1) the same code runs eagerly: the CPU tests compare its tokens with the torch
runner's (tests/engine/test_gpu_*.py).

Runs on the GPU path, unchanged above it: the scheduler, continuous batching and chunked prefill, the prefix cache,
preemption, n > 1, seeded sampling, logprobs and prompt logprobs, structured outputs (an uploaded grammar mask),
thinking budgets, sleep / wake_up, caches in KV groups (Gemma 2/3's sliding-window layers beside global ones:
each group's block tables and slots in the step's one upload, the backend's per-group buffers), speculative
decoding (n-gram or a draft model; drafts verified on the device, gpu_verify), mixtures of experts (routed on the
device by the fused kernel, runlm.kernels.triton.fused_moe, its stacked weights from runlm.models.gpu_moe; a layer
it cannot take routes on the host, eagerly), LoRA adapters (in device slots, each row's slot uploaded with the step:
runlm.kernels.triton.lora's kernels, torch ops where Triton does not run; in the decode graphs too), images (the
tower on the device; an image's rows written over its placeholders in a prefill step; Gemma 3's bidirectional spans
by a second pass over those rows; Qwen2.5-VL's M-RoPE positions, [3, T], uploaded beside the step), gpt-oss's
attention sinks and Llama 4's chunked attention (in the attention kernel), DeepSeek's latent attention (the cache of
latents as one KV head, runlm.models.mla). Nothing a family holds is refused: every family the torch runner runs runs
here. Per step, the sampler hands logit_bias, allowed_token_ids, min_tokens and DRY to the numpy sampler
(gpu_sampler, logged once).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from runlm.dtypes import torch_dtype
from runlm.engine.core.batch_plan import BatchPlan, plan_batch
from runlm.engine.core.encoder_cache import EncoderCache
from runlm.engine.core.kv_groups import AnyBlockManager, HybridBlockManager
from runlm.engine.core.mm_step import mrope_positions, step_images
from runlm.engine.core.overlap import fed_rows
from runlm.engine.core.scheduler import SchedulerOutput
from runlm.engine.runners.gpu_graphs import StepLayout, graph_batch_sizes, is_decode_only, pack_step, padded_batch_size
from runlm.engine.runners.gpu_offload import (
    OffloadBackend,
    device_kv_bytes_per_token,
    host_kv_bytes_per_token,
    offload_backend,
)
from runlm.engine.runners.gpu_sampler import SampleLaunch, launch_sample, to_device
from runlm.engine.runners.gpu_verify import sample_and_verify_on_device
from runlm.engine.runners.torch_runner import States, allocate_states, image_rows
from runlm.engine.sample.rejection import spec_rows
from runlm.engine.sample.sampler import SampledToken, add_prompt_logprobs
from runlm.engine.structured.backend import StructuredOutputManager
from runlm.engine.types.config import EngineConfig, kv_cache_blocks
from runlm.kernels.triton.backend import PagedAttentionBackend
from runlm.models import lora
from runlm.models.attention import ForwardContext, forward_context
from runlm.models.load import LoadedModel
from runlm.models.moe import host_routed_experts
from runlm.models.offload import host_layers_skipped

log = logging.getLogger("runlm.gpu")



# ids drawn by a step still running, for a step's stand-in tokens: (their rows, or None for the first rows; the ids)
Fill = tuple[torch.Tensor | None, torch.Tensor]


@dataclass(slots=True)
class PackedStep:
    """What a step's forward pass needs beside its packed host array (gpu_graphs.pack_step): all that tensor
    parallelism's other ranks are sent with the array's bytes."""
    layout: StepLayout
    graph_size: int | None  # the decode graph it replays (None: eager)
    query_lens: list[int]
    context_lens: list[int]


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # the captured forward's output [size, hidden]


class GPURunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, blocks: AnyBlockManager,
                 structured: StructuredOutputManager | None = None, kv_heads: int | None = None,
                 device: torch.device | None = None) -> None:
        """``kv_heads`` and ``device``: a tensor-parallel rank's own (runlm.engine.runners.tp_gpu)."""
        self.config, self.loaded, self.blocks, self.structured = config, loaded, blocks, structured
        self.kv_heads = kv_heads
        # speculative decoding: the speculating sequences' 1 + k rows run in the step beside the others (eagerly:
        # the decode graphs take one row a sequence), verified on the device (gpu_verify)
        self.speculating = config.speculative_config is not None
        self.dtype, self.device = torch_dtype(config.dtype), device or torch.device(config.device)
        # the paged cache's: the compute dtype, or float8 e4m3 (--kv-cache-dtype fp8: half a bf16 cache's bytes)
        self.cache_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        self.encoder_cache = EncoderCache()  # the engine hands it its own (reset_mm_cache)
        mc = loaded.config
        self.max_model_len = mc.context_length(config.max_model_len)
        self.max_seqs = config.max_num_seqs
        self.max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.max_blocks_per_seq = -(-self.max_model_len // config.block_size)
        # a cache in KV groups (Gemma 2/3's sliding-window layers): each group after the first has its own blocks
        self.group_managers = blocks.groups[1:] if isinstance(blocks, HybridBlockManager) else []
        layout = StepLayout(self.max_tokens, self.max_seqs, self.max_blocks_per_seq, len(self.group_managers))
        pinned = self.device.type == "cuda"
        self.host = torch.empty(layout.size, dtype=torch.int64, pin_memory=pinned)
        self.host_np = self.host.numpy()
        self.staging = torch.empty(layout.size, dtype=torch.int64, device=self.device)
        # the last upload: the pinned array is written again only once the copy out of it is done
        self.uploaded = torch.cuda.Event() if pinned else None
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device)
        # M-RoPE (Qwen2.5-VL): [3, T] positions, one row per axis, uploaded beside the packed step
        self.mrope = loaded.vision is not None and loaded.vision.uses_mrope
        shape = (3, self.max_tokens) if self.mrope else (self.max_tokens,)
        self.positions = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self.backend: PagedAttentionBackend | OffloadBackend | None = None
        self.states: States = None
        self.graphs: dict[int, _Graph] = {}
        self.graph_sizes = graph_batch_sizes(self.max_seqs)
        self.allocate_kv_cache()

    # ---- the cache, and the graphs captured over it -------------------------------------------
    def allocate_kv_cache(self) -> None:
        mc = self.loaded.config
        _sync_free_rope(self.loaded.model, self.max_model_len, self.device)  # (the weights may be new: wake_up)
        hybrid = self.blocks if isinstance(self.blocks, HybridBlockManager) else None
        num_blocks = [len(g.blocks) for g in hybrid.groups] if hybrid else self.blocks.layer_blocks(0)
        heads, k_dim, v_dim = mc.kv_cache_shape  # (latent attention: one latent row a token, its own values)
        heads = self.kv_heads or heads
        split = self.loaded.offload
        if split is not None:  # layer offload: the CPU layers' K/V in a cache on the host
            self.backend = offload_backend(mc, split, num_blocks, self.blocks.block_size, self.cache_dtype,
                                           self.device, self.max_seqs, self.max_tokens, self.max_blocks_per_seq,
                                           hybrid.layer_group if hybrid else None)
        else:
            self.backend = PagedAttentionBackend(mc.num_layers, num_blocks, self.blocks.block_size, heads, k_dim,
                                                 self.cache_dtype, self.device, self.max_seqs, self.max_tokens,
                                                 self.max_blocks_per_seq, kv_layers=mc.kv_layers, latent=v_dim == 0,
                                                 layer_group=hybrid.layer_group if hybrid else None)
        # recurrent layers' (conv, ssm) states, a row per state slot (runlm.models.mamba2)
        self.states = allocate_states(mc, self.blocks.state_slots, self.device)
        self.lora_rows = self._device_lora()
        if self.device.type == "cuda" and not self.config.enforce_eager:
            if split is not None:
                log.info("CUDA graphs off: layer offload runs %d layers on the CPU", split.host_layers)
            elif not self.backend.graphable:
                log.info("CUDA graphs off: the attention backend %s reads the host", type(self.backend).__name__)
            elif mc.recurrent_layers:  # (runlm.models.mamba2.by_sequence groups the step's rows on the host)
                log.info("CUDA graphs off: the recurrent layers group their rows on the host")
            elif moe_on_host := host_routed_experts(self.loaded.model, self.device.type):
                log.info("CUDA graphs off: the mixture of experts routes its tokens on the host (%s)", moe_on_host)
            else:
                self.capture_graphs()

    def _device_lora(self) -> torch.Tensor | None:
        """With LoRA enabled: the model's adapters in device slots (enable_device; a reloaded model gets them again)
        and the buffer of each row's slot the steps (and graphs) read."""
        if not self.config.enable_lora:
            return None
        enable_device_lora(self.loaded.model, self.config)
        return torch.full((self.max_tokens,), -1, dtype=torch.int32, device=self.device)

    def release_memory(self) -> None:
        """After a step that ran out of memory: the caching allocator's free blocks back to the device."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def free_kv_cache(self) -> None:
        self.graphs = {}
        self.backend = None
        self.states = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cache as [slots, KVH, D] (the torch runner's layout; the same memory)."""
        return self.backend.flat_caches() if self.backend is not None else []

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """One graph per padded decode size, largest first (they share one memory pool)."""
        assert isinstance(self.backend, PagedAttentionBackend)
        pool = None
        model = self.loaded.model
        for size in sorted(self.graph_sizes, reverse=True):
            cu = torch.arange(size + 1, dtype=torch.int32)
            table, slots = torch.zeros((size, 1), dtype=torch.int32), torch.full((size,), -1, dtype=torch.int64)
            self.backend.set_step(table, cu, torch.ones(size, dtype=torch.int32), slots,
                                  groups=[(table, slots)] * len(self.group_managers))
            ctx = ForwardContext([1] * size, [1] * size, None, None, None, backend=self.backend,
                                 lora_rows=None if self.lora_rows is None else self.lora_rows[:size])
            ids, pos = self.input_ids[:size], self.positions[..., :size]
            with forward_context(ctx):
                model(ids, pos)  # warm-up: lazy initialisations happen outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = model(ids, pos)
            pool = graph.pool()
            self.graphs[size] = _Graph(graph, hidden)
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batches of %s sequences", sorted(self.graphs))

    # ---- a step -------------------------------------------------------------------------------
    overlaps = True  # the engine may queue the next step before this one's tokens are read (async scheduling)

    def execute(self, sched: SchedulerOutput) -> list[SampledToken]:
        return self.launch(sched).result()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, fed: SampleLaunch | None = None) -> SampleLaunch:
        """The step queued on the device: its forward pass and its draws (the SampleLaunch's result() waits for
        them). ``fed``: the step still running, whose drawn ids this step's stand-in tokens take, on the device
        (runlm.engine.core.overlap)."""
        plan = plan_batch(sched, self.blocks)
        fill: Fill | None = None
        if fed is not None and fed.tokens is not None:
            fed_at, sources = fed_rows(sched, plan.ids, fed.seqs)
            if fed_at == list(range(len(plan.ids))) and sources == list(range(len(fed.seqs))):
                fill = None, fed.tokens  # (a decode step of the same sequences: every row, in order)
            elif fed_at:
                fill = to_device(fed_at, self.device), fed.tokens[to_device(sources, self.device)]
        hidden = self.run_model(sched, plan, fill)
        for rows in plan.prompt_logprob_rows:
            logits = self.loaded.model.compute_logits(hidden[rows.first_row:rows.first_row + rows.count])
            add_prompt_logprobs(rows.seq, logits.float().cpu().numpy(), rows.first_pos)
        if self.speculating:  # drafts verified on the device (gpu_verify; the host's verifier where it must)
            wanted = plan.sample_rows + spec_rows(plan.spec_rows, plan.spec_seqs)
            if not wanted:
                return SampleLaunch.done([])
            raw = self.loaded.model.compute_logits(hidden[to_device(wanted, self.device)])
            return SampleLaunch.done(sample_and_verify_on_device(raw, plan.sample_seqs, plan.spec_seqs,
                                                                 self.structured))
        if not plan.sample_seqs:
            return SampleLaunch.done([])
        sample_rows = plan.sample_rows
        last = hidden[:len(sample_rows)] if sample_rows == list(range(len(sample_rows))) else \
            hidden[to_device(sample_rows, self.device)]
        return launch_sample(self.loaded.model.compute_logits(last), plan.sample_seqs, self.structured)

    def run_model(self, sched: SchedulerOutput, plan: BatchPlan, fill: Fill | None = None) -> torch.Tensor:
        """``fill``: ids drawn by the step still running, for the stand-ins among this step's (forward_packed)."""
        assert self.backend is not None, "the KV cache was freed (sleep)"
        b = len(plan.query_lens)
        if self.uploaded is not None:
            self.uploaded.synchronize()
        size = padded_batch_size(b, list(self.graphs)) if self.graphs and is_decode_only(plan) else None
        # each group's block tables: BlockTable.groups holds a sequence's tables of the groups after the first
        group_tables = [[s.table.groups[g].blocks for s in sched.seqs] for g in range(len(self.group_managers))]
        layout = pack_step(plan, [s.table.blocks for s in sched.seqs], self.blocks.block_size, self.host_np,
                           pad_seqs=size, group_tables=group_tables)
        step = PackedStep(layout, size, list(plan.query_lens), list(plan.context_lens))
        self.share_step(step, plan)
        mrope = mrope_positions(sched, len(plan.ids)) if self.mrope else None
        lora_rows = lora.row_slots(self.loaded.model, plan.query_lens) if self.lora_rows is not None else None

        def configure(ctx: ForwardContext) -> None:
            if self.states is not None:
                ctx.states, ctx.state_slots, ctx.state_fresh = self.states, plan.state_slots, plan.state_fresh
            vision = self.loaded.vision
            images = step_images(sched) if vision is not None else None
            if images is not None:  # (an image's rows come in prefill steps: never a graph's)
                assert vision is not None
                ctx.mm_embeds = image_rows(self.encoder_cache, images, vision, self.device)
                ctx.bidirectional = images.bidirectional  # (Gemma 3: those rows again, with their spans' mask)

        return self.forward_packed(step, mrope, lora_rows, configure, fill)

    def share_step(self, step: PackedStep, plan: BatchPlan) -> None:
        """A packed step about to run (tensor parallelism's runner hands it to the other ranks)."""

    def forward_packed(self, step: PackedStep, mrope: np.ndarray | None = None, lora_rows: np.ndarray | None = None,
                       configure: Callable[[ForwardContext], None] | None = None,
                       fill: Fill | None = None) -> torch.Tensor:
        """The forward pass over the step packed in the host array: uploaded, spread into the model's and the
        backend's buffers, then a decode graph replayed or the model run eagerly (``configure``: what else the
        step's context holds: states, images). ``fill``: (rows, ids) written over the uploaded ids on the device,
        the draws of the step still running (async scheduling); rows None: the ids are the step's first rows,
        and the upload's are not needed. [rows, hidden]."""
        assert self.backend is not None, "the KV cache was freed (sleep)"
        layout, b, max_query_len = step.layout, len(step.query_lens), max(step.query_lens)
        parts = self.upload(layout)
        t, shape = layout.num_tokens, (layout.num_seqs, layout.width)
        fed_at, drawn = fill if fill is not None else (None, None)
        if drawn is not None and fed_at is None:  # every row a stand-in: the running step's draws in their place
            self.input_ids[:drawn.shape[0]].copy_(drawn)
        else:
            self.input_ids[:t].copy_(parts["ids"])
            if fed_at is not None and drawn is not None:  # stand-ins for what the running step draws
                self.input_ids.index_copy_(0, fed_at, drawn)
        if mrope is not None:  # (padding rows at position 0)
            rows = np.zeros((3, t), dtype=np.int64)
            rows[:, :mrope.shape[1]] = mrope
            self.positions[:, :t].copy_(torch.from_numpy(rows), non_blocking=self.uploaded is not None)
        else:
            self.positions[:t].copy_(parts["positions"])
        extra = range(1, 1 + len(self.group_managers))
        groups = [(parts[f"block_table{g}"].view(shape), parts[f"slot_mapping{g}"]) for g in extra]
        backend = self.backend
        if isinstance(backend, OffloadBackend):  # the host's cache addressed from the packed host array
            host = {name: self.host_np[off:off + length] for name, (off, length) in layout.parts().items()}
            backend.set_host_step(host["block_table"].reshape(shape), host["cu_seqlens_q"], host["seq_lens"],
                                  host["slot_mapping"], [(host[f"block_table{g}"].reshape(shape),
                                                          host[f"slot_mapping{g}"]) for g in extra], max_query_len)
            backend = backend.device
        backend.set_step(parts["block_table"].view(shape), parts["cu_seqlens_q"], parts["seq_lens"],
                         parts["slot_mapping"], groups=groups, max_query_len=max_query_len)
        if self.lora_rows is not None and lora_rows is not None:  # each row's adapter slot (-1: none, padding)
            self.lora_rows[:len(lora_rows)].copy_(torch.from_numpy(lora_rows), non_blocking=True)
            self.lora_rows[len(lora_rows):t].fill_(-1)
        if step.graph_size is not None:
            graph = self.graphs[step.graph_size]
            graph.graph.replay()
            return graph.hidden[:b]
        ctx = ForwardContext(step.query_lens, step.context_lens, None, None, None, backend=self.backend,
                             lora_rows=None if self.lora_rows is None else self.lora_rows[:t])
        if configure is not None:
            configure(ctx)
        with forward_context(ctx):
            return self.loaded.model(self.input_ids[:t], self.positions[..., :t])

    def upload(self, layout: StepLayout) -> dict[str, torch.Tensor]:
        """The packed step to the device in one copy; its parts as views of the staging buffer."""
        n = layout.size
        self.staging[:n].copy_(self.host[:n], non_blocking=self.uploaded is not None)
        if self.uploaded is not None:
            self.uploaded.record()
        return {name: self.staging[off:off + length] for name, (off, length) in layout.parts().items()}


def _sync_free_rope(model: torch.nn.Module, max_len: int, device: torch.device) -> None:
    """RoPE tables grown to max_len on the device once, and looked up without reading the positions on the host
    (RotaryEmbedding._tables checks their maximum: a host sync, which no CUDA graph can capture)."""
    from runlm.models.rope import RotaryEmbedding

    for rope in {id(m): m for m in model.modules() if isinstance(m, RotaryEmbedding)}.values():
        if getattr(rope, "long", None) is not None or rope.on_host:
            continue  # long-context RoPE (Phi-3) picks its tables by the positions; a layer offload's CPU layers'
            # copies stay on the host: both keep their own lookup
        rope.ensure_positions(max_len)
        rope.cos, rope.sin = rope.cos.to(device).contiguous(), rope.sin.to(device).contiguous()
        rope.sync_free = True

        def tables(positions: torch.Tensor, dev: torch.device, r: RotaryEmbedding = rope
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            return r.cos[positions], r.sin[positions]
        rope._tables = tables  # type: ignore[method-assign,assignment]


def enable_device_lora(model: torch.nn.Module, config: EngineConfig) -> None:
    """The model's LoRA adapters in device slots, once: one per adapter kept loaded (max_cpu_loras) plus one per
    adapter a step may run (max_loras), for adapters evicted while their requests still run."""
    if getattr(model, "lora_slots", None) is None:
        kept = config.max_cpu_loras or config.max_loras
        lora.enable_device(model, kept + config.max_loras, config.max_lora_rank, torch_dtype(config.dtype))


def gpu_kv_cache_blocks(config: EngineConfig, loaded: LoadedModel, bytes_per_token: int, max_model_len: int,
                        device: torch.device | None = None) -> int:
    """KV-cache blocks for the GPU runner. On CUDA (vLLM's way): after the weights, profile one largest step
    (max_num_batched_tokens tokens), and give the cache what is left of gpu_memory_utilization x the device's
    memory; refused when not even one sequence of max_model_len fits, naming both sizes. An explicit
    kv_cache_memory in bytes wins. On a CPU: the engine's kv_cache_memory budget, unchanged. ``device``: a
    tensor-parallel rank's own (default: the config's)."""
    device = device or torch.device(config.device)
    split = loaded.offload
    if split is not None:  # layer offload: the device holds its layers' K/V, the host the CPU layers' (both capped)
        host_blocks = kv_cache_blocks(config, host_kv_bytes_per_token(loaded.config, split), max_model_len)
        itemsize = 1 if config.kv_cache_dtype == "fp8" else torch_dtype(config.dtype).itemsize
        bytes_per_token = device_kv_bytes_per_token(loaded.config, split, bytes_per_token, itemsize)
        with host_layers_skipped(loaded.model):  # (the profile's step on the GPU layers alone)
            return min(host_blocks, gpu_kv_cache_blocks(config, replace(loaded, offload=None), bytes_per_token,
                                                        max_model_len, device))
    if device.type != "cuda" or (config.kv_cache_memory is not None and not isinstance(config.kv_cache_memory,
                                                                                       float)):
        return kv_cache_blocks(config, bytes_per_token, max_model_len)
    block_bytes = bytes_per_token * config.block_size
    total = torch.cuda.get_device_properties(device).total_memory
    budget = kv_budget_after_profile(config, loaded, device)
    need = -(-max_model_len // config.block_size) * block_bytes
    if budget < need:
        used = int(config.gpu_memory_utilization * total) - budget
        raise ValueError(f"the model needs {used / 2**30:.2f} GiB of GPU memory for its weights and one step of "
                         f"{config.max_num_batched_tokens} tokens, and its KV cache {need / 2**30:.2f} GiB for one "
                         f"sequence of {max_model_len} tokens, but gpu_memory_utilization "
                         f"{config.gpu_memory_utilization} of {total / 2**30:.2f} GiB leaves only "
                         f"{max(budget, 0) / 2**30:.2f} GiB: lower --max-model-len or --max-num-batched-tokens, or "
                         f"raise --gpu-memory-utilization")
    blocks = budget // block_bytes
    log.info("GPU memory: %.2f GiB of %.2f GiB for runlm; KV cache %.2f GiB (%d blocks of %d tokens)",
             config.gpu_memory_utilization * total / 2**30, total / 2**30, blocks * block_bytes / 2**30, blocks,
             config.block_size)
    return int(blocks)


@torch.inference_mode()
def kv_budget_after_profile(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> int:
    """Bytes left for the KV cache: utilization x total, less the weights, one largest step's peak (activations
    and logits, measured) and what other processes hold on the device."""
    if config.enable_lora:  # (the adapters' device slots are held beside the weights: counted before the cache)
        enable_device_lora(loaded.model, config)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    mc = loaded.config
    max_len = mc.context_length(config.max_model_len)
    n = config.max_num_batched_tokens
    lens = [min(max_len, n - i) for i in range(0, n, max_len)]
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(x, device=device) for x in lens])
    with forward_context(ForwardContext.no_cache(lens)):
        hidden = loaded.model(ids, positions)
    rows = min(config.max_num_seqs, n)
    logits = loaded.model.compute_logits(hidden[:rows]).float()
    torch.softmax(logits, dim=-1)
    del hidden, logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    return int(config.gpu_memory_utilization * total) - peak - others

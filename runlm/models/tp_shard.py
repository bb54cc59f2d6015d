"""A loaded decoder cut down to one tensor-parallel rank's part (Megatron's split, vLLM's names):

* column-parallel qkv_proj and gate_up_proj: the rank's query heads, its KV heads (each rank keeps the KV head its
  queries read where there are fewer KV heads than ranks), its slice of the MLP's width; no communication;
* row-parallel o_proj and down_proj: the matching input columns, then one all-reduce each (the bias after it);
* a vocab-parallel embedding (a rank looks up its rows, zeros elsewhere, one all-reduce) and LM head (a rank's
  logits columns, gathered on rank 0).

A decoder step is thus 2 all-reduces a layer and 1 for the embedding. Weights are cut as loaded: fp32 (exact
numerics), int8 blocks or GGUF blocks (a matrix's input columns cut at whole blocks), and the GPU runner's forms:
dense in the compute dtype, or GGUF blocks kept for its kernels (Linear.device_blocks).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from runlm.kernels import ggml
from runlm.models.config import ModelConfig
from runlm.models.linear import Embedding, GGMLWeight, Int8Parts, Linear
from runlm.models.llama import MLP, Attention, LlamaForCausalLM, UngatedMLP
from runlm.models.lora_weights import LoRAError, LoRAModule, LoRAWeights
from runlm.models.tp_comm import Communicator

INT8_BLOCK = 32  # the values of one int8 block (runlm.models.linear.BlockQuantized)


def why_not_tp(cfg: ModelConfig, size: int) -> str | None:
    """What in the model keeps it from being split ``size`` ways (None: it splits)."""
    if cfg.num_experts:
        return "mixtures of experts"
    if cfg.recurrent_layers:
        return "recurrent layers"
    if cfg.kv_lora_rank:
        return "latent attention (MLA)"
    if cfg.qk_norm_whole:
        return "q/k norms over the whole projection (OLMo 2's)"
    if cfg.attn_output_gate or cfg.attention_sinks:
        return "gated attention outputs and attention sinks"
    if cfg.num_heads % size:
        return f"{cfg.num_heads} attention heads, which {size} ranks cannot share evenly"
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        return f"{kv} KV heads, which {size} ranks can neither share nor each keep whole"
    if cfg.intermediate_size % size:
        return f"an MLP {cfg.intermediate_size} wide, which {size} ranks cannot share evenly"
    return None


@dataclass(frozen=True, slots=True)
class Split:
    """Rank ``rank`` of ``size``: its query heads, its KV heads and its share of each width."""
    rank: int
    size: int
    heads: int     # the model's
    kv_heads: int  # the model's

    @property
    def local_heads(self) -> int:
        return self.heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(self.kv_heads // self.size, 1)

    @property
    def first_kv_head(self) -> int:
        if self.kv_heads >= self.size:
            return self.rank * self.local_kv_heads
        # fewer KV heads than ranks: the one this rank's query heads read (each KV head kept by size/kv ranks)
        return self.rank * self.local_heads // (self.heads // self.kv_heads)

    def share(self, n: int) -> tuple[int, int]:
        """This rank's [lo, hi) of n things split evenly (n divisible by size)."""
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part

    def vocab(self, n: int) -> tuple[int, int, int]:
        """(lo, hi, rows per rank) of a vocabulary of n: ceil(n / size) rows a rank, the last one's fewer."""
        part = -(-n // self.size)
        lo = min(self.rank * part, n)
        return lo, min(lo + part, n), part


def shard_model(model: LlamaForCausalLM, comm: Communicator) -> Split:
    """Cut ``model`` down to ``comm.rank``'s part, in place; raises ValueError for a layer it cannot split."""
    cfg = model.config
    reason = why_not_tp(cfg, comm.size)
    if reason is not None:
        raise ValueError(f"tensor parallelism does not split {reason}")
    split = Split(comm.rank, comm.size, cfg.num_heads, cfg.num_kv_heads)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(attn) is not Attention or type(mlp) not in (MLP, UngatedMLP):
            raise ValueError(f"tensor parallelism does not split the {cfg.family} family's layer {i} "
                             f"({type(layer).__name__})")
        _shard_attention(attn, split, comm)
        assert isinstance(mlp, MLP | UngatedMLP)
        _shard_mlp(mlp, split, comm)
    _shard_vocab(model, split, comm)
    model.model._plan = None  # (the fused loop's plan reads the layers' new shapes when it is next built)
    return split


def _shard_attention(attn: Attention, split: Split, comm: Communicator) -> None:
    d, heads, kv = attn.head_dim, split.local_heads, split.local_kv_heads
    q_lo = split.rank * heads * d
    k_lo = attn.q_size + split.first_kv_head * d
    v_lo = k_lo + attn.kv_size
    take_rows(attn.qkv_proj, [(q_lo, q_lo + heads * d), (k_lo, k_lo + kv * d), (v_lo, v_lo + kv * d)])
    attn.o_proj = RowParallel.of(attn.o_proj, q_lo, q_lo + heads * d, comm)
    attn.heads, attn.kv_heads, attn.q_size, attn.kv_size = heads, kv, heads * d, kv * d


def _shard_mlp(mlp: MLP | UngatedMLP, split: Split, comm: Communicator) -> None:
    size = mlp.down_proj.in_features
    lo, hi = split.share(size)
    if isinstance(mlp, MLP):
        take_rows(mlp.gate_up_proj, [(lo, hi), (size + lo, size + hi)])
    else:
        take_rows(mlp.up_proj, [(lo, hi)])
    mlp.down_proj = RowParallel.of(mlp.down_proj, lo, hi, comm)


def _shard_vocab(model: LlamaForCausalLM, split: Split, comm: Communicator) -> None:
    vocab = model.config.vocab_size
    lo, hi, part = split.vocab(vocab)
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, lo, hi, comm)  # type: ignore
    for head in (model.lm_head, model.tied_head):
        if head is not None:
            take_rows(head, [(lo, hi)])

    def gather(logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] < part:  # the last rank's fewer rows, padded so every rank sends the same shape
            logits = nn.functional.pad(logits, (0, part - logits.shape[-1]))
        return comm.gather_cols(logits, vocab)

    model.gather_vocab = gather


class RowParallel(Linear):
    """A linear layer's input columns [lo, hi) on this rank; the ranks' partial outputs (each with its LoRA
    update, whose A is cut the same way) summed, with the bias added once (rank 0's, before the sum)."""
    comm: Communicator
    row_bias: torch.Tensor | None

    @classmethod
    def of(cls, linear: Linear, lo: int, hi: int, comm: Communicator) -> RowParallel:
        """``linear`` itself, cut and turned into a RowParallel (its weights, in whatever form, stay put)."""
        bias = linear.bias
        linear.register_parameter("bias", None)
        take_cols(linear, lo, hi)
        linear.__class__ = cls
        assert isinstance(linear, RowParallel)
        linear.comm = comm
        linear.row_bias = bias if comm.rank == 0 else None
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.row_bias is not None:
            y = y + self.row_bias
        return self.comm.all_reduce(y.contiguous())

    def direct_call(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.forward


class VocabParallelEmbedding(nn.Module):
    """The embedding rows [lo, hi) on this rank: a token outside them looks up zeros, and the ranks' rows are
    summed (exactly one rank holds each token's)."""

    def __init__(self, table: Embedding, lo: int, hi: int, comm: Communicator) -> None:
        super().__init__()
        if table.ggml is not None:
            g = table.ggml
            table.keep_ggml(GGMLWeight(g.raw[lo:hi], g.qtype, hi - lo, g.cols))
        elif table.device_blocks is not None:  # (the GPU runner's table in its blocks)
            g = table.device_blocks
            table.keep_device_blocks(GGMLWeight(g.raw[lo:hi], g.qtype, hi - lo, g.cols), table._rows,
                                     table.rows_dtype)
        else:
            table.weight = nn.Parameter(table.weight[lo:hi].contiguous(), requires_grad=False)
        table.num_embeddings = hi - lo
        self.table, self.lo, self.hi, self.comm = table, lo, hi, comm

    @property
    def weight(self) -> torch.Tensor:
        """The rows held (tied embeddings' LM head reads them: this rank's logits)."""
        return self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        rows = self.table(torch.where(mine, ids - self.lo, 0))
        rows = torch.where(mine.unsqueeze(-1), rows, 0.0).contiguous()
        return self.comm.all_reduce(rows)


def take_rows(linear: Linear, ranges: list[tuple[int, int]]) -> None:
    """Keep the output rows in ``ranges`` (in order), whichever way the weight is held."""
    if linear.ggml:
        linear.keep_ggml([piece for lo, hi in ranges for piece in _ggml_rows(linear.ggml, lo, hi)])
    elif linear.device_blocks:
        linear.keep_device_blocks([piece for lo, hi in ranges for piece in _ggml_rows(_blocks(linear), lo, hi)],
                                  linear._blocks_forward.func)
    elif linear.qweight is not None:
        assert linear.scales is not None and linear.offsets is not None
        q, s, o = linear.qweight, linear.scales, linear.offsets
        linear.keep_quantized(Int8Parts(*(torch.cat([t[lo:hi] for lo, hi in ranges]) for t in (q, s, o))))
    else:
        linear.weight = nn.Parameter(torch.cat([linear.weight[lo:hi] for lo, hi in ranges]), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(torch.cat([linear.bias[lo:hi] for lo, hi in ranges]), requires_grad=False)
    linear.out_features = sum(hi - lo for lo, hi in ranges)


def _blocks(linear: Linear) -> list[GGMLWeight]:
    """The GPU runner's GGUF blocks of a layer; a pre-quantized checkpoint's matrices are refused."""
    if not all(isinstance(s, GGMLWeight) for s in linear.device_blocks):
        raise ValueError("tensor parallelism does not cut a pre-quantized checkpoint's (GPTQ, AWQ, FP8) matrices; "
                         "serve it with tensor_parallel_size 1")
    return list(linear.device_blocks)


def _ggml_rows(segments: list[GGMLWeight], lo: int, hi: int) -> list[GGMLWeight]:
    """Rows [lo, hi) of a layer's stacked segments, as views of the segments they fall in."""
    out, start = [], 0
    for s in segments:
        a, b = max(lo, start), min(hi, start + s.rows)
        if a < b:
            out.append(GGMLWeight(s.raw[a - start:b - start], s.qtype, b - a, s.cols))
        start += s.rows
    return out


def take_cols(linear: Linear, lo: int, hi: int) -> None:
    """Keep the input columns [lo, hi); a block-quantized weight is cut at whole blocks only."""
    if linear.ggml or linear.device_blocks:
        pieces = []
        for s in linear.ggml or _blocks(linear):
            block = ggml.block_size(s.qtype)
            if lo % block or hi % block:
                raise ValueError(f"tensor parallelism cuts a {linear.in_features}-column matrix at column {lo}, "
                                 f"inside one of its {block}-value quantized blocks; use fewer ranks or an "
                                 "unquantized model")
            a, b = ggml.row_bytes(s.qtype, lo), ggml.row_bytes(s.qtype, hi)
            pieces.append(GGMLWeight(s.raw[:, a:b].contiguous(), s.qtype, s.rows, hi - lo))
        if linear.ggml:
            linear.keep_ggml(pieces)
        else:
            linear.keep_device_blocks(pieces, linear._blocks_forward.func)
    elif linear.qweight is not None:
        if lo % INT8_BLOCK or hi % INT8_BLOCK:
            raise ValueError(f"tensor parallelism cuts a {linear.in_features}-column matrix at column {lo}, inside "
                             f"one of its {INT8_BLOCK}-value int8 blocks; use fewer ranks")
        assert linear.scales is not None and linear.offsets is not None
        b0, b1 = lo // INT8_BLOCK, hi // INT8_BLOCK
        linear.keep_quantized(Int8Parts(linear.qweight[:, lo:hi], linear.scales[:, b0:b1],
                                        linear.offsets[:, b0:b1]))
    else:
        linear.weight = nn.Parameter(linear.weight[:, lo:hi].contiguous(), requires_grad=False)
    linear.in_features = hi - lo


def shard_adapter(weights: LoRAWeights, cfg: ModelConfig, split: Split) -> LoRAWeights:
    """A LoRA adapter cut as the layers it adapts are: B's rows of a column-parallel projection (the rank's
    heads, KV heads or MLP share), A's columns of a row-parallel one (whose partial updates the all-reduce sums)."""
    d, heads, kv = cfg.head_dim, split.local_heads, split.local_kv_heads
    q_full, kv_full = cfg.num_heads * d, cfg.num_kv_heads * d
    q = (split.rank * heads * d, (split.rank + 1) * heads * d)
    k = (q_full + split.first_kv_head * d, q_full + (split.first_kv_head + kv) * d)
    v = (k[0] + kv_full, k[1] + kv_full)
    size = cfg.intermediate_size
    mlp = split.share(size)
    rows: dict[str, list[tuple[int, int]]] = {  # module -> B's rows kept (in the module's own output)
        "q_proj": [(0, heads * d)], "k_proj": [(0, kv * d)], "v_proj": [(0, kv * d)], "qkv_proj": [q, k, v],
        "gate_proj": [mlp], "up_proj": [mlp], "gate_up_proj": [mlp, (size + mlp[0], size + mlp[1])]}
    starts = {"q_proj": q[0], "k_proj": k[0] - q_full, "v_proj": v[0] - q_full - kv_full}
    cols = {"o_proj": q, "down_proj": mlp}  # module -> A's columns kept
    out: dict[str, LoRAModule] = {}
    for name, m in weights.modules.items():
        kind = name.rsplit(".", 1)[-1]
        if kind in cols:
            lo, hi = cols[kind]
            out[name] = LoRAModule(m.a[:, lo:hi].contiguous(), m.b)
        elif kind in rows:
            shift = starts.get(kind, 0)
            out[name] = LoRAModule(m.a, torch.cat([m.b[lo + shift:hi + shift] for lo, hi in rows[kind]]))
        else:
            raise LoRAError(f"{weights.source}: tensor parallelism does not cut a LoRA on {name}")
    return LoRAWeights(out, weights.source)

"""The Mamba2 mixer (state-space duality, Dao and Gu 2024), as Granite 4, Bamba, Nemotron-H and Mamba2 itself
compute it, over a recurrent state kept per sequence instead of a KV cache:

    z, xBC, dt = in_proj(x)                      (the gate, the convolved channels, one step size per head)
    xBC = silu(causal_conv1d(xBC))               (its last taps - 1 inputs are the sequence's conv state)
    x, B, C = xBC;  dt = softplus(dt + dt_bias)
    h_t = exp(dt_t A) h_(t-1) + dt_t x_t B_t^T   (per head: h [head_dim, state]; the sequence's SSM state)
    y_t = h_t C_t + D x_t
    out = out_proj(rmsnorm(y * silu(z)))         (the norm over groups of the inner width)

A prompt's rows are scanned in chunks (the quadratic form within a chunk, the recurrence across chunks); a
decode step's rows, one per sequence, in one batched update. States are float32 whatever the compute dtype.
Where the step's ForwardContext carries states, each sequence reads its slot's state (zero for its first tokens)
and leaves its new state there; without (runlm.models.evaluate.all_logits) every sequence starts from zero.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runlm.models.attention import get_forward_context
from runlm.models.config import ModelConfig
from runlm.models.linear import Linear

CHUNK = 64  # prompt rows scanned at once (the within-chunk form costs chunk^2 per head)


class GatedRMSNorm(nn.Module):
    """rmsnorm(y * silu(z)) over each of ``groups`` equal parts of the width, times a weight ("after_gate"); or
    rmsnorm(y) * silu(z) ("before_gate", Falcon-H1's option); or no norm, y * silu(z) ("none": no weight)."""

    def __init__(self, dim: int, groups: int, eps: float, mode: str = "after_gate") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if mode != "none" else None
        self.groups, self.eps, self.mode = groups, eps, mode

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gate = F.silu(z.float())
        if self.weight is None:
            return (y.float() * gate).to(y.dtype)
        g = (y.float() * gate if self.mode == "after_gate" else y.float()).unflatten(-1, (self.groups, -1))
        g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        if self.mode == "after_gate":
            return self.weight * g.to(y.dtype)
        return (self.weight.float() * g * gate).to(y.dtype)


class Conv1d(nn.Module):
    """A depthwise causal convolution's weights as checkpoints store them: weight [channels, 1, taps], bias."""

    def __init__(self, channels: int, taps: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, taps))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


class Mamba2Mixer(nn.Module):
    """x [T, hidden] -> [T, hidden] for layer ``layer``: the rows of every sequence in the step, in batch order."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.head_dim, self.state = cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_state
        self.groups, self.taps = cfg.ssm_groups, cfg.ssm_conv_kernel
        self.inner, self.conv_dim = cfg.ssm_heads * cfg.ssm_head_dim, cfg.ssm_conv_dim
        self.in_proj = Linear(cfg.hidden_size, self.inner + self.conv_dim + self.heads, bias=cfg.ssm_proj_bias)
        self.conv1d = Conv1d(self.conv_dim, self.taps, cfg.ssm_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        self.norm = GatedRMSNorm(self.inner, cfg.ssm_groups, cfg.rms_norm_eps, cfg.ssm_norm)
        self.out_proj = Linear(self.inner, cfg.hidden_size, bias=cfg.ssm_proj_bias)
        self.dt_limit = cfg.ssm_dt_limit

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.heads], dim=-1)
        y = by_sequence(self.layer, [xbc, dt], self.inner, self._scan)
        return self.out_proj(self.norm(y.to(x.dtype), z))

    def _scan(self, inputs: list[torch.Tensor], slots: Slots) -> torch.Tensor:
        """``b`` sequences of ``L`` rows each (xbc [b, L, conv_dim], dt [b, L, heads]) from their slots' states,
        their new states kept. Returns y [b, L, inner], float32."""
        xbc, dt = inputs
        b, length = xbc.shape[:2]
        conv = F.silu(causal_conv(xbc, self.conv1d, slots))  # [b, L, conv_dim]
        xs, B, C = conv.split([self.inner, self.groups * self.state, self.groups * self.state], dim=-1)
        step = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        xs = xs.reshape(b, length, self.heads, self.head_dim)
        repeat = self.heads // self.groups  # B and C are shared by the heads of a group
        B = B.reshape(b, length, self.groups, self.state).repeat_interleave(repeat, dim=2)
        C = C.reshape(b, length, self.groups, self.state).repeat_interleave(repeat, dim=2)
        ssm0 = slots.load(1, (b, self.heads, self.head_dim, self.state), xbc)
        out, ssm = ssd_scan(xs, step, -torch.exp(self.A_log.float()), B, C, ssm0)
        slots.keep(1, ssm)
        out = out + self.D.float()[:, None] * xs
        return out.reshape(b, length, self.inner)


State = tuple[torch.Tensor, torch.Tensor]  # a layer's (conv, ssm) states, one row per state slot


@dataclass(slots=True)
class Slots:
    """The states of ``b`` sequences in one recurrent layer: the layer's ``store`` (None: nothing is kept), their
    rows ``index`` in it, and whether they start from zero (``fresh``: their first tokens)."""
    store: State | None
    index: torch.Tensor
    fresh: bool

    def load(self, part: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """The states the sequences start from (part 0: the convolution's, 1: the SSM's), float32."""
        if self.store is None or self.fresh:
            return like.new_zeros(shape, dtype=torch.float32)
        return self.store[part][self.index]

    def keep(self, part: int, value: torch.Tensor) -> None:
        if self.store is not None:
            self.store[part][self.index] = value


def by_sequence(layer: int, inputs: list[torch.Tensor], width: int,
                run: Callable[[list[torch.Tensor], Slots], torch.Tensor]) -> torch.Tensor:
    """A recurrent layer over the step's rows ``inputs`` (each [T, ...]) -> [T, width] float32: ``run(rows, slots)``
    takes ``b`` sequences of ``L`` rows each ([b, L, ...]) and their states; the decode rows (one per sequence, its
    state kept) go in one batch, a prompt's rows sequence by sequence."""
    ctx = get_forward_context()
    device = inputs[0].device
    y = torch.empty(inputs[0].shape[0], width, dtype=torch.float32, device=device)
    starts = [0, *itertools.accumulate(ctx.query_lens)]
    store = ctx.states[layer] if ctx.states is not None else None
    fresh = ctx.state_fresh or [True] * len(ctx.query_lens)
    slots = ctx.state_slots or [-1] * len(ctx.query_lens)
    decode = [i for i, n in enumerate(ctx.query_lens) if n == 1 and not fresh[i] and store is not None]
    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=device)
        index = torch.tensor([slots[i] for i in decode], device=device)
        y[rows] = run([t[rows, None] for t in inputs], Slots(store, index, False))[:, 0]
    done = set(decode)
    for i, (a, b) in enumerate(itertools.pairwise(starts)):
        if i not in done and b > a:
            y[a:b] = run([t[None, a:b] for t in inputs], Slots(store, torch.tensor([slots[i]], device=device),
                                                               fresh[i]))[0]
    return y


def causal_conv(x: torch.Tensor, conv: Conv1d, slots: Slots) -> torch.Tensor:
    """The depthwise causal convolution of ``b`` sequences' rows x [b, L, channels] after each one's last
    ``taps - 1`` inputs (its conv state), which then become the last ``taps - 1`` of its inputs. Returns
    [b, L, channels], float32."""
    b, _, channels = x.shape
    taps = conv.weight.shape[-1]
    full = torch.cat([slots.load(0, (b, channels, taps - 1), x), x.float().transpose(1, 2)], dim=-1)
    slots.keep(0, full[..., full.shape[-1] - (taps - 1):])  # (full: [b, channels, taps - 1 + L])
    bias = conv.bias.float() if conv.bias is not None else None
    return F.conv1d(full, conv.weight.float(), bias, groups=channels).transpose(1, 2)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """h_t = exp(dt_t A) h_(t-1) + dt_t x_t B_t^T, y_t = h_t C_t over L steps of b sequences, from ``state``.
    x [b, L, heads, p]; dt [b, L, heads]; A [heads]; B, C [b, L, heads, n]; state [b, heads, p, n].
    Returns (y [b, L, heads, p], the state after the last step). Within a chunk y is the quadratic form
    y_t = sum_(s<=t) exp(a_s+1 + ... + a_t) (C_t . B_s) dt_s x_s plus the carried state's part."""
    out = []
    for s in range(0, x.shape[1], chunk):
        xc, dtc, Bc, Cc = x[:, s:s + chunk], dt[:, s:s + chunk], B[:, s:s + chunk], C[:, s:s + chunk]
        cum = torch.cumsum(dtc * A, dim=1)  # [b, l, heads]: log-decay from the chunk's start
        n = cum.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()[None, :, :, None]
        decay = torch.exp((cum[:, :, None] - cum[:, None]).masked_fill(~causal, float("-inf")))  # [b, t, s, h]
        xdt = xc * dtc[..., None]
        y = torch.einsum("btsh,bshp->bthp", torch.einsum("bthn,bshn->btsh", Cc, Bc) * decay, xdt)
        y = y + torch.einsum("bthn,bhpn->bthp", Cc, state) * torch.exp(cum)[..., None]
        last = cum[:, -1]  # [b, heads]
        carry = torch.exp(last[:, None] - cum)  # [b, l, heads]: decay from each step to the chunk's end
        state = state * torch.exp(last)[..., None, None] + torch.einsum("bshn,bshp->bhpn", Bc * carry[..., None], xdt)
        out.append(y)
    return torch.cat(out, dim=1), state

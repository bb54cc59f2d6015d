"""Qwen3-Next's gated DeltaNet (Yang et al. 2024), linear attention over a state kept per sequence:

    q, k, v = in_proj_qkv(x);  z = in_proj_z(x);  b, a = in_proj_ba(x)
                          (llama.cpp's layout: every query, key, value row in turn; HF checkpoints' in_proj_qkvz
                          groups them by key head and is split so on loading: runlm.models.qwen3_next)
    q, k, v = silu(causal_conv1d(q, k, v))                     (the convolution's last taps - 1 inputs: a conv state)
    q, k = l2norm(q) / sqrt(d_k), l2norm(k);  beta = sigmoid(b);  g = -exp(A_log) softplus(a + dt_bias)
    S_t = exp(g_t) S_(t-1);  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t    (per value head: S [d_k, d_v])
    out = out_proj(rmsnorm(o) * silu(z))                       (the norm per value head, before the gate)

A prompt's rows are computed in chunks (the delta rule's updates within a chunk folded into one triangular solve, the
state carried across chunks); decode rows, one per sequence, in one batch (runlm.models.mamba2.by_sequence). States
are float32."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runlm.models.config import ModelConfig
from runlm.models.linear import Linear
from runlm.models.mamba2 import Conv1d, Slots, by_sequence, causal_conv

CHUNK = 64


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.v_heads, self.k_heads = cfg.ssm_heads, cfg.ssm_groups
        self.dk, self.dv = cfg.ssm_head_dim, cfg.ssm_state
        self.key_dim, self.value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        h = cfg.hidden_size
        self.in_proj_qkv = Linear(h, 2 * self.key_dim + self.value_dim, bias=False)
        self.in_proj_z = Linear(h, self.value_dim, bias=False)
        self.in_proj_ba = Linear(h, 2 * self.v_heads, bias=False)
        self.conv1d = Conv1d(cfg.ssm_conv_dim, cfg.ssm_conv_kernel, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads))
        self.A_log = nn.Parameter(torch.empty(self.v_heads))
        self.norm = _NormThenGate(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, bias=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t, per = x.shape[0], self.v_heads // self.k_heads
        mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)
        b, a = self.in_proj_ba(x).view(t, self.k_heads, 2 * per).split([per, per], dim=-1)  # (by key head)
        beta = torch.sigmoid(b.reshape(t, self.v_heads).float())
        g = -torch.exp(self.A_log.float()) * F.softplus(a.reshape(t, self.v_heads).float() + self.dt_bias.float())
        o = by_sequence(self.layer, [mixed, beta, g], self.value_dim, self._run)
        o = self.norm(o.view(t, self.v_heads, self.dv), z.reshape(t, self.v_heads, self.dv).float())
        return self.out_proj(o.reshape(t, self.value_dim).to(x.dtype))

    def _run(self, inputs: list[torch.Tensor], slots: Slots) -> torch.Tensor:
        mixed, beta, g = inputs
        bsz, length = mixed.shape[:2]
        conv = F.silu(causal_conv(mixed, self.conv1d, slots))
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        per = self.v_heads // self.k_heads  # each key head serves this many value heads
        q = _l2norm(q.reshape(bsz, length, self.k_heads, self.dk)).repeat_interleave(per, dim=2) * self.dk ** -0.5
        k = _l2norm(k.reshape(bsz, length, self.k_heads, self.dk)).repeat_interleave(per, dim=2)
        v = v.reshape(bsz, length, self.v_heads, self.dv)
        out, state = gated_delta_scan(q, k, v, g, beta, slots.load(1, (bsz, self.v_heads, self.dk, self.dv), mixed))
        slots.keep(1, state)
        return out.reshape(bsz, length, self.value_dim)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


class _NormThenGate(nn.Module):
    """weight * rmsnorm(o) * silu(z) over each value head (Qwen3-Next's gated norm: a plain weight, no 1 + w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * o * F.silu(z)


def gated_delta_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = exp(g_t) S_(t-1) + k_t (beta_t (v_t - exp(g_t) S_(t-1)^T k_t))^T, o_t = S_t^T q_t over L steps of b
    sequences. q, k [b, L, heads, d_k]; v [b, L, heads, d_v]; g, beta [b, L, heads]; state [b, heads, d_k, d_v].
    Returns (o [b, L, heads, d_v], the state after the last step).

    Within a chunk, with G_ij = exp(cum_i - cum_j) the decay from step j to step i (cum: g summed from the chunk's
    start), the updates' corrections u solve (I + strict_lower(diag(beta) K K^T * G)) u = beta (V - exp(cum) K S_0)
    -- the delta rule's chain of updates as one unit lower-triangular system -- and then
    o = exp(cum) Q S_0 + (lower(Q K^T * G)) u,  S = exp(cum_last) S_0 + (K exp(cum_last - cum))^T u."""
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))  # heads before steps
    length = q.shape[2]
    out = []
    for s in range(0, length, chunk):
        qc, kc, vc, gc, bc = (x[:, :, s:s + chunk] for x in (q, k, v, g, beta))
        n = qc.shape[2]
        cum = gc.cumsum(-1)  # [b, h, n]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")))  # [b, h, n, n]
        system = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        eye = torch.eye(n, dtype=system.dtype, device=system.device)
        rhs = bc[..., None] * (vc - torch.exp(cum)[..., None] * (kc @ state))
        u = torch.linalg.solve_triangular(system + eye, rhs, upper=False, unitriangular=True)
        o = torch.exp(cum)[..., None] * (qc @ state) + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        last = cum[..., -1:]  # [b, h, 1]
        state = state * torch.exp(last)[..., None] + (kc * torch.exp(last - cum)[..., None]).transpose(-1, -2) @ u
        out.append(o)
    return torch.cat(out, dim=2).transpose(1, 2), state

"""MiniMax (``MiniMaxForCausalLM``: MiniMax-Text-01 and M1 as transformers writes them): lightning attention on the
``linear_attention`` layers (runlm.models.minimax: a decaying state per head and sequence, no prefix caching, no
speculation), softmax attention on the others, Mixtral's experts, DeepNorm's residual factors. llama.cpp's converter
reads the remote-code checkpoints (``MiniMaxText01ForCausalLM``) only. Not the native runner's, nor the GPU
runner's."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runlm.models.families import Family

_FACTORS = tuple(f"{kind}_{f}_factor" for kind in ("full_attn", "linear_attn", "mlp") for f in ("alpha", "beta"))


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 8 == 0 else "linear_attention"
                                       for i in range(fields["num_layers"])]
    return dict(recurrent_layers=[i for i, t in enumerate(types) if t == "linear_attention"],
                recurrent_kind="lightning", ssm_heads=fields["num_heads"], ssm_head_dim=fields["head_dim"],
                ssm_state=fields["head_dim"], ssm_conv_kernel=1,
                multipliers={k: cfg[k] for k in _FACTORS if cfg.get(k) is not None})


FAMILY = Family("minimax", torch_model="runlm.models.minimax:MiniMaxForCausalLM", norm_topk_prob=True,
                hf_fields=_hf_fields, native=False, native_safetensors=False)

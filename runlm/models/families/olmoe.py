"""OLMoE: q/k RMSNorm over the whole projection, q/k/v clipping (where set), experts."""
from runlm.models.families import Family

FAMILY = Family("olmoe", torch_model="runlm.models.moe:MoeForCausalLM", qk_norm=True, qk_norm_whole=True,
                )

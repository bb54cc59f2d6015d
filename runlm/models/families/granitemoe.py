"""GraniteMoE (Granite 3.0/3.1 MoE): Granite 3's multipliers (runlm.models.families.granite) around a mixture of experts
in every layer, softmax over the router's chosen logits (the top-k renormalized). Its checkpoints stack each layer's
experts (``block_sparse_moe.input_linear``, gate and up together; ``output_linear``), split per expert on loading;
llama.cpp's ``granitemoe`` files split them already. Not the native runner's, nor the GPU runner's yet."""
from runlm.models.families import Family
from runlm.models.families.granite import FAMILY as GRANITE

FAMILY = Family("granitemoe", torch_model="runlm.models.granite:GraniteMoeForCausalLM", norm_topk_prob=True,
                gguf_norm_topk_prob=True, hf_fields=GRANITE.hf_fields, gguf_fields=GRANITE.gguf_fields, native=False,
                native_safetensors=False)

"""OLMo 2: norms after attention and after the MLP, none before (runlm.models.olmo2), q/k norms over the whole
projection. llama.cpp names its norms post_attention_norm and post_ffw_norm. Not the native runner's yet: its
decoder normalizes each layer's input."""
from runlm.models.families import Family

FAMILY = Family("olmo2", torch_model="runlm.models.olmo2:Olmo2ForCausalLM", qk_norm=True, qk_norm_whole=True,
                gguf_tensor_names={"post_attention_norm": "post_attention_layernorm",
                                   "post_ffw_norm": "post_feedforward_layernorm"},
                native=False, native_safetensors=False)

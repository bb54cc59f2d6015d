"""llama.cpp's tensor names against Hugging Face's for a decoder's weights, in one table both ways: the loaders read
GGUF files under HF names (runlm.models.weights), the converter writes HF checkpoints under GGUF names
(runlm.quantize.convert). No torch here."""
from __future__ import annotations

# per layer: ``blk.N.<gguf>`` <-> ``model.layers.N.<hf>`` (families add their own: Family.gguf_tensor_names)
GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    # mixtures of experts: the router (and its choice bias), each layer's experts stacked in one tensor per
    # projection ({e}: the expert), and the shared expert (with Qwen2-MoE's gate)
    "ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.score_bias",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # Mamba2 mixers (their HF module: Granite 4's and Bamba's name)
    "ssm_in": "mamba.in_proj", "ssm_out": "mamba.out_proj", "ssm_conv1d": "mamba.conv1d", "ssm_norm": "mamba.norm",
}
# per layer, tensors that are one parameter each, not a module's weight or bias: ``blk.N.<gguf>`` <->
# ``model.layers.N.<hf>``. (llama.cpp stores a Mamba2 mixer's A = -exp(A_log), not A_log.)
GGUF_LAYER_PARAMS = {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias"}
# the model's own: ``<gguf>`` <-> ``<hf>``
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

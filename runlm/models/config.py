"""One typed description of a decoder model, read from a HF config.json or GGUF metadata."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runlm.formats import ModelFormatError
from runlm.formats.architectures import DECODERS, supported_decoders
from runlm.models import families

DECODER_FAMILIES = frozenset(DECODERS)


@dataclass(slots=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # per layer "sliding_attention" or "full_attention"; None: sliding_window (if any) applies to every layer
    layer_types: list[str] | None = None
    hidden_act: str = "silu"              # the MLP's gate activation: "silu" or "gelu_tanh"
    embed_scale: float | None = None      # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    norm_offset: float = 0.0              # added to every stored norm weight (HF Gemma's 1 + w convention)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (default head_dim)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    rope_local_theta: float | None = None  # RoPE base of sliding-window layers, when it differs (Gemma 3)
    partial_rotary_factor: float = 1.0    # RoPE rotates the first head_dim * this features of each head
    qk_norm_whole: bool = False           # q/k RMSNorm over the whole projection, not per head (OLMoE)
    qk_norm_after_rope: bool = False      # q/k RMSNorm on the rotated heads (Hunyuan), not before RoPE
    clip_qkv: float | None = None         # q, k, v clamped to +-this (OLMoE)
    # mixture of experts (num_experts 0: a dense MLP in every layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0        # each expert's (0: intermediate_size)
    shared_expert_intermediate_size: int = 0  # the always-on expert(s) beside the routed ones (Qwen2-MoE's gated)
    norm_topk_prob: bool = False          # renormalize the chosen experts' probabilities to sum to 1
    moe_gating: str = "softmax"           # the router's scores: "softmax" over the experts, or each one's "sigmoid"
    moe_score_bias: bool = False          # a per-expert bias added to the scores to choose (not to weigh) experts
    moe_groups: int = 1                   # experts in groups; a token chooses among the moe_groups_used best groups
    moe_groups_used: int = 1              # (a group's score: its two best experts' biased scores, summed)
    routed_scaling: float = 1.0           # the chosen experts' weights times this (DeepSeek-V3's routed_scaling_factor)
    dense_layers: list[int] = field(default_factory=list)  # layers with a dense MLP in a MoE model
    nope_layers: list[int] = field(default_factory=list)  # layers whose q and k RoPE does not rotate (SmolLM3)
    gated_mlp: bool = True                # act(gate) * up; False: act(up) alone (Arcee's ReLU²)
    residual_scale: float = 1.0           # each layer's attention and MLP output times this before the add (Granite)
    logit_scale: float = 1.0              # the logits times this (Granite: 1 / logits_scaling)
    parallel_residual: bool = False       # x + attn(norm(x)) + mlp(norm(x)), one norm (StableLM's option, Phi-2)
    mlp_bias: bool = False                # the MLP's projections have biases (Phi-2)
    lm_head_bias: bool = False            # the output projection has a bias (Phi-2)
    norm_bias: bool = True                # LayerNorm families: their norms have a bias (Cohere's have none)
    # multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank 0: none): head_dim is then the query's and key's
    # (no-RoPE part + qk_rope_head_dim), and the cache holds a kv_lora_rank + qk_rope_head_dim latent per token
    kv_lora_rank: int = 0
    q_lora_rank: int = 0                  # the query's own low-rank pair (V3; 0: one projection)
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_sinks: bool = False         # a learned logit per head in each softmax's denominator (gpt-oss)
    swiglu_limit: float | None = None     # gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit, (up + 1) glu
    router_bias: bool = False             # the router has a bias (gpt-oss)
    moe_weight_input: bool = False        # each chosen expert's input scaled by its weight, not its output (Llama 4)
    attention_chunk: int | None = None    # layers typed "chunked_attention" attend within chunks of this many (Llama 4)
    qk_l2_norm: bool = False              # q and k RMS-normalized without a weight after RoPE, RoPE layers only
    attn_floor_scale: float = 0.0         # Llama 4's temperature tuning on its no-RoPE layers (0: none): queries
    attn_temperature_scale: float = 0.0   # times log1p(floor((pos + 1) / floor_scale)) * scale + 1
    moe_group_max: bool = False           # a group's score is its best expert's (DeepSeek-V2), not its best two's
    # Mamba2 mixers (runlm.models.mamba2) in place of attention on these layers (Granite 4, Bamba, ...): ssm_heads
    # heads of ssm_head_dim, a state of ssm_state per head, B and C in ssm_groups groups, a causal convolution of
    # ssm_conv_kernel taps; each sequence keeps a recurrent state per such layer instead of a KV cache
    recurrent_layers: list[int] = field(default_factory=list)
    mlp_layers: list[int] = field(default_factory=list)  # layers that are an MLP (or experts) alone (Nemotron-H)
    ssm_heads: int = 0
    ssm_head_dim: int = 0
    ssm_state: int = 0
    ssm_groups: int = 1
    ssm_conv_kernel: int = 4
    ssm_conv_bias: bool = True
    ssm_proj_bias: bool = False
    ssm_dt_limit: tuple[float, float] = (0.0, float("inf"))  # the step size dt clamped to this range
    # what the recurrent layers are: "mamba2" (runlm.models.mamba2), "short_conv" (LFM2's gated short convolutions,
    # runlm.models.short_conv: ssm_conv_kernel taps over the hidden width; their state is the convolution's alone) or
    # "gated_delta" (Qwen3-Next's gated DeltaNet, runlm.models.gated_delta: ssm_heads value heads of ssm_state, keys
    # and queries in ssm_groups heads of ssm_head_dim; a state [ssm_heads, ssm_head_dim, ssm_state] per sequence) or
    # "lightning" (MiniMax's lightning attention, runlm.models.minimax: the attention's heads, a decaying
    # [head_dim, head_dim] state each; no convolution)
    recurrent_kind: str = "mamba2"
    ssm_norm: str = "after_gate"          # a Mamba2 mixer's output: rmsnorm(y * silu(z)); "before_gate": rmsnorm(y)
    # * silu(z) (Falcon-H1's option); "none": y * silu(z)
    parallel_mixers: bool = False         # each layer runs attention and a Mamba2 mixer side by side (Falcon-H1)
    # µP multipliers a family's model folds into its weights on loading, by the HF config's names (Falcon-H1's)
    multipliers: dict[str, Any] = field(default_factory=dict)
    attn_output_gate: bool = False        # attention's output times sigmoid of a per-head gate from q_proj (Qwen3-Next)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def layer_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None: it attends to the whole context)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_chunk(self, layer: int) -> int | None:
        """The attention chunk of ``layer`` (None: it attends to its whole context, or its window)."""
        if self.layer_types is not None and self.layer_types[layer] == "chunked_attention":
            return self.attention_chunk
        return None

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim if self.kv_lora_rank else int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(heads, K width, V width) of a layer's cache per token: every KV head's K and V, or (latent attention)
        one latent row and no V."""
        if self.kv_lora_rank:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def kv_layers(self) -> list[int]:
        """The layers that keep a KV cache (all but the recurrent ones)."""
        without = set() if self.parallel_mixers else {*self.recurrent_layers, *self.mlp_layers}
        return [i for i in range(self.num_layers) if i not in without]

    @property
    def ssm_conv_dim(self) -> int:
        """The channels a Mamba2 mixer convolves: its inner width, then B's and C's groups (a short convolution: the
        hidden width)."""
        if self.recurrent_kind == "short_conv":
            return self.hidden_size
        if self.recurrent_kind == "gated_delta":  # queries, keys, values
            return 2 * self.ssm_groups * self.ssm_head_dim + self.ssm_heads * self.ssm_state
        if self.recurrent_kind == "lightning":
            return 0
        return self.ssm_heads * self.ssm_head_dim + 2 * self.ssm_groups * self.ssm_state

    @property
    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's recurrent state in one Mamba2 layer: the convolution's last inputs [conv_dim, taps - 1]
        and the SSM state [heads, head_dim, state]."""
        return (self.ssm_conv_dim, self.ssm_conv_kernel - 1), (self.ssm_heads, self.ssm_head_dim, self.ssm_state)

    @property
    def state_bytes_per_seq(self) -> int:
        """What one sequence's recurrent states take, in float32, over every recurrent layer."""
        (c, k), (h, p, n) = self.state_shapes
        return len(self.recurrent_layers) * 4 * (c * k + h * p * n)

    @property
    def layer_norm(self) -> bool:
        """StableLM's families: LayerNorm (mean-centred, with a bias unless norm_bias says not), not RMSNorm."""
        return families.get(self.family).layer_norm

    @property
    def sandwich_norms(self) -> bool:
        """Gemma 2/3: norms after attention and after the MLP as well as before them."""
        return families.get(self.family).sandwich_norms

    @property
    def mixer_blocks(self) -> bool:
        """Nemotron-H, Mamba2: each layer is one norm and one mixer (Mamba2, attention, an MLP or experts)."""
        return families.get(self.family).mixer_blocks

    @property
    def shared_expert_gate(self) -> bool:
        """Qwen2-MoE: the shared expert's output scaled by a sigmoid gate (the others add theirs as is)."""
        return families.get(self.family).shared_expert_gate

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention's output projection has a bias (Llama's attention_bias covers it, Qwen2's not)."""
        return self.attention_bias and families.get(self.family).o_proj_bias

    def context_length(self, max_model_len: int | None) -> int:
        """The positions an engine serves: its max_model_len, at most (and by default) the model's own."""
        return min(max_model_len or self.max_position_embeddings, self.max_position_embeddings)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def _params(self, experts: int) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        norm = 2 * h if self.layer_norm and self.norm_bias else h  # (a LayerNorm's bias beside its weight)
        attention = h * (q + 2 * kv) + q * h + (4 if self.sandwich_norms else 1 if self.parallel_residual else 2) * norm
        if self.attention_bias:  # Llama's covers o_proj too, Qwen2's only q, k and v
            attention += q + 2 * kv + (h if self.o_proj_bias else 0)
        if self.attention_sinks:
            attention += self.num_heads
        if self.attn_output_gate:  # (q_proj's gate rows)
            attention += h * q
        if self.kv_lora_rank:  # latent attention's projections instead
            attention = self._latent_attention_params() + 2 * norm
        if self.qk_norm:
            attention += q + kv if self.qk_norm_whole else 2 * self.head_dim
        projections = 3 if self.gated_mlp else 2  # (an expert's too)
        expert = projections * h * self.expert_size + (2 * self.expert_size + h if self.mlp_bias else 0)
        moe = experts * expert + self.num_experts * (h + self.moe_score_bias + self.router_bias) \
            + projections * h * self.shared_expert_intermediate_size \
            + (h if self.shared_expert_intermediate_size and self.shared_expert_gate else 0)
        mlp = projections * h * self.intermediate_size
        if self.mlp_bias:
            mlp += (2 if self.gated_mlp else 1) * self.intermediate_size + h
        if self.hidden_act == "xielu":  # its four learned values
            mlp += 4
        recurrent, alone = set(self.recurrent_layers), set(self.mlp_layers)
        if self.mixer_blocks:  # one norm and one mixer a layer
            layers = sum(norm + (self._mamba_params() if i in recurrent else moe if self.is_moe_layer(i) else mlp
                                 if i in alone else attention - 2 * norm) for i in range(self.num_layers))
        else:
            layers = sum((self._mamba_params() if i in recurrent else 0)  # (attention's count holds the two norms)
                         + (attention if self.parallel_mixers or i not in recurrent else 2 * norm)
                         + (moe if self.is_moe_layer(i) else mlp) for i in range(self.num_layers))
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + emb + norm + (self.vocab_size if self.lm_head_bias else 0)

    def _mamba_params(self) -> int:
        h, heads, conv = self.hidden_size, self.ssm_heads, self.ssm_conv_dim
        if self.recurrent_kind == "short_conv":  # in_proj (B, C, x), the convolution, out_proj
            return 4 * h * h + h * self.ssm_conv_kernel + (5 * h if self.ssm_conv_bias else 0)
        if self.recurrent_kind == "lightning":  # qkv, output gate and out projections, the norm
            inner = heads * self.ssm_head_dim
            return 3 * h * inner + h * inner + inner * h + inner
        if self.recurrent_kind == "gated_delta":  # q, k, v, z and b, a projections, convolution, A, dt, norm, out
            values = heads * self.ssm_state
            return h * (conv + values + 2 * heads) + conv * self.ssm_conv_kernel + 2 * heads + self.ssm_state \
                + values * h
        inner = heads * self.ssm_head_dim
        proj = inner + conv + heads
        bias = (proj + h) if self.ssm_proj_bias else 0
        norm = inner if self.ssm_norm != "none" else 0
        return h * proj + conv * self.ssm_conv_kernel + (conv if self.ssm_conv_bias else 0) + 3 * heads + norm \
            + inner * h + bias

    def _latent_attention_params(self) -> int:
        h, heads, rank, rope = self.hidden_size, self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        ql, bias = self.q_lora_rank, self.attention_bias
        query = h * ql + (ql if bias else 0) + ql + ql * heads * self.head_dim if ql else h * heads * self.head_dim
        kv = h * (rank + rope) + (rank + rope if bias else 0) + rank \
            + rank * heads * (self.head_dim - rope + self.v_head_dim)
        return query + kv + heads * self.v_head_dim * h + (h if bias else 0)

    @property
    def num_params(self) -> int:
        """Every weight, every expert included (what memory must hold)."""
        return self._params(self.num_experts)

    @property
    def num_active_params(self) -> int:
        """The weights one token reads: only its num_experts_per_tok experts."""
        return self._params(self.num_experts_per_tok)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        arch = (cfg.get("architectures") or [None])[0]
        family = families.for_hf(arch, cfg.get("model_type", ""))
        if family is None:
            raise ModelFormatError(f"{source}: architecture {arch or cfg.get('model_type')!r} is not a supported "
                                   f"decoder (supported: {supported_decoders()})")
        heads = int(cfg.get("num_attention_heads") or 1)  # (a model without attention (Mamba2) names none)
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta")
        local_theta = cfg.get("rope_local_base_freq")
        if isinstance(scaling, Mapping) and "full_attention" in scaling:  # per layer type (Gemma 3)
            local_theta = (scaling.get("sliding_attention") or {}).get("rope_theta", local_theta)
            scaling = scaling["full_attention"]
        partial = cfg.get("partial_rotary_factor")
        if isinstance(scaling, Mapping):
            theta = theta or scaling.get("rope_theta")
            partial = partial or scaling.get("partial_rotary_factor")
            if scaling.get("rope_type", scaling.get("type", "default")) == "default":
                scaling = None
        if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
            scaling = _longrope_scaling(scaling, cfg)
        pattern = family.sliding_pattern
        local_global = pattern is not None
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
        # (Nemotron-H's configs count their layers by their pattern alone)
        layers = int(cfg.get("num_hidden_layers")
                     or len(cfg.get("hybrid_override_pattern") or cfg["layers_block_type"]))
        step = int(cfg.get("decoder_sparse_step") or 1)
        first_moe = int(cfg.get("first_k_dense_replace") or 0)  # (DeepSeek's, GLM-4.5's, dots1's leading dense layers)
        dense = [i for i in range(layers) if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step
                 or i < first_moe]
        expert_size = int(cfg.get("moe_intermediate_size") or 0)
        layer_types = cfg.get("layer_types")
        if pattern is not None and not layer_types:  # configs written before transformers named each layer's type
            n = int(cfg.get("sliding_window_pattern") or pattern)
            layer_types = ["sliding_attention" if (i + 1) % n else "full_attention"
                           for i in range(layers)]
        sliding = cfg.get("use_sliding_window", family.sliding_window)
        fields: dict[str, Any] = dict(
            family=family.name, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0), num_layers=layers,
            num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            # (LayerNorm families: their own key, StarCoder2's norm_epsilon, and their reference's default)
            rms_norm_eps=float(cfg.get("layer_norm_eps", cfg.get("norm_epsilon", 1e-5)) if family.layer_norm
                               else cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta or 10000.0),
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", family.attention_bias))),
            qk_norm=family.qk_norm, qk_norm_whole=family.qk_norm_whole, qk_norm_after_rope=family.qk_norm_after_rope,
            clip_qkv=cfg.get("clip_qkv"),
            num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate_size=expert_size,
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size")
                                                or int(cfg.get("n_shared_experts") or 0) * expert_size),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", family.norm_topk_prob)),
            moe_gating=str(cfg.get("scoring_func", family.moe_gating)), moe_score_bias=family.moe_score_bias,
            moe_groups=int(cfg.get("n_group") or 1), moe_groups_used=int(cfg.get("topk_group") or 1),
            routed_scaling=float(cfg.get("routed_scaling_factor") or 1.0),
            dense_layers=dense if experts else [],
            sliding_window=cfg.get("sliding_window") if sliding else None,
            layer_types=list(layer_types) if local_global and layer_types else None,
            hidden_act=family.hidden_act, gated_mlp=family.gated_mlp,
            embed_scale=hidden ** 0.5 if family.scaled_embeddings else None, norm_offset=family.hf_norm_offset,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            attn_logit_softcap=cfg.get("attn_logit_softcapping"),
            final_logit_softcap=cfg.get("final_logit_softcapping"),
            rope_local_theta=float(local_theta) if local_global and local_theta else None,
            partial_rotary_factor=float(partial or 1.0),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])],
        )
        if family.hf_fields is not None:
            fields.update(family.hf_fields(cfg, fields))
        return cls(**fields)

    @classmethod
    def from_gguf(cls, gguf: Any) -> ModelConfig:
        arch = gguf.architecture
        family = families.for_gguf(arch)
        if family is None:
            raise ModelFormatError(f"{gguf.path}: GGUF architecture {arch!r} is not a supported decoder "
                                   f"(supported: {supported_decoders()})")

        def get(key: str, default: Any = None) -> Any:
            return gguf.metadata.get(f"{arch}.{key}", default)

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count") or 1)  # (0: no attention, Mamba2)
        kv_heads = get("attention.head_count_kv", heads)
        tensors = gguf.tensors
        vocab = get("vocab_size") or len(gguf.metadata.get("tokenizer.ggml.tokens", [])) \
            or tensors["token_embd.weight"].shape[0]
        head_dim = int(get("attention.key_length") or hidden // heads)
        scaling = None
        stype = get("rope.scaling.type")
        if stype and stype != "none":
            scaling = {"rope_type": stype, "factor": float(get("rope.scaling.factor", 1.0))}
            if get("rope.scaling.original_context_length"):
                scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
        if "rope_factors_long.weight" in tensors:  # Phi-3's LongRoPE: the factors are tensors of the file
            orig = int(get("rope.scaling.original_context_length"))
            scaling = {"rope_type": "longrope", "original_max_position_embeddings": orig,
                       "factor": int(get("context_length")) / orig,
                       "long_factor": gguf.load_array("rope_factors_long.weight").tolist(),
                       "short_factor": gguf.load_array("rope_factors_short.weight").tolist()}
            if get("rope.scaling.attn_factor") is not None:
                scaling["attention_factor"] = float(get("rope.scaling.attn_factor"))
        rotary = get("rope.dimension_count")
        eos = gguf.metadata.get("tokenizer.ggml.eos_token_id")
        window, layer_types = get("attention.sliding_window"), None
        # (GLM-4.5's count includes its multi-token-prediction layers, which the decoder does not run)
        layers = int(get("block_count")) - int(get("nextn_predict_layers") or 0)
        # local:global layer patterns where the file names none (every n-th layer is global), as llama.cpp fixes them
        pattern = get("attention.sliding_window_pattern", family.sliding_pattern)
        if window and pattern:  # llama.cpp: layer i is local unless i % pattern == pattern - 1
            pattern = pattern if isinstance(pattern, list) else [i % pattern < pattern - 1 for i in range(layers)]
            layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
        experts = int(get("expert_count") or 0)
        if experts and family.gguf_with_experts is not None:
            family = families.get(family.gguf_with_experts)
        # (the first attention layer's: a hybrid's first layer may have none)
        q_norm = next((tensors[f"blk.{i}.attn_q_norm.weight"] for i in range(layers)
                       if f"blk.{i}.attn_q_norm.weight" in tensors), None)
        moe_layer = next((i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors), 0)
        shared = tensors.get(f"blk.{moe_layer}.ffn_up_shexp.weight")  # (its rows: the size metadata may misstate)
        fields: dict[str, Any] = dict(
            family=family.name, vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=_largest(get("feed_forward_length")), num_layers=layers,
            # (a list: per layer, 0 for a recurrent one)
            num_heads=heads, num_kv_heads=int(kv_heads if not isinstance(kv_heads, list) else max(kv_heads)),
            head_dim=head_dim, rms_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5) if family.layer_norm
                                                  else get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            qk_norm=q_norm is not None, qk_norm_whole=q_norm is not None and q_norm.shape[-1] != head_dim,
            qk_norm_after_rope=q_norm is not None and family.qk_norm_after_rope,
            num_experts=experts, num_experts_per_tok=int(get("expert_used_count") or 0),
            moe_intermediate_size=int(get("expert_feed_forward_length") or 0),
            shared_expert_intermediate_size=int(shared.shape[0]) if shared is not None else 0,
            # llama.cpp's per-architecture choice where the file does not say
            norm_topk_prob=bool(get("expert_weights_norm", family.gguf_norm_topk_prob)),
            moe_gating=_GGUF_GATING.get(get("expert_gating_func"), family.moe_gating),
            moe_score_bias=f"blk.{moe_layer}.exp_probs_b.bias" in tensors,
            moe_groups=int(get("expert_group_count") or 1), moe_groups_used=int(get("expert_group_used_count") or 1),
            routed_scaling=float(get("expert_weights_scale") or 1.0),
            dense_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors] if experts else [],
            sliding_window=window or None, layer_types=layer_types,
            partial_rotary_factor=int(rotary) / head_dim if rotary else 1.0,
            hidden_act=family.hidden_act, gated_mlp=family.gated_mlp,
            embed_scale=hidden ** 0.5 if family.scaled_embeddings else None,
            # llama.cpp scales queries by key_length ** -0.5 (query_pre_attn_scalar = head_dim, as Gemma's
            # released models but 27B have), unless the file says otherwise
            query_pre_attn_scalar=get("attention.scale") ** -2 if get("attention.scale") else None,
            attn_logit_softcap=get("attn_logit_softcapping"), final_logit_softcap=get("final_logit_softcapping"),
            rope_local_theta=get("rope.freq_base_swa", family.gguf_rope_local_theta),
            bos_token_id=gguf.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
        )
        if family.gguf_fields is not None:
            fields.update(family.gguf_fields(get, fields))
        return cls(**fields)


def _largest(value: Any) -> int:
    """A GGUF length that may be given per layer (a list: Nemotron-H's feed-forward lengths, 0 where a layer has no
    MLP): the largest."""
    return int(max(value) if isinstance(value, list) else value)


# llama.cpp's expert_gating_func values (llama_expert_gating_func_type)
_GGUF_GATING = {1: "softmax", 2: "sigmoid"}


def _longrope_scaling(scaling: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
    """LongRoPE's parameters as transformers reads them: original_max_position_embeddings may sit beside
    rope_scaling, and the factor, when absent, is max_position_embeddings over it."""
    out = dict(scaling)
    orig = int(out.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
    out["original_max_position_embeddings"] = orig
    out["factor"] = out.get("factor") or int(cfg["max_position_embeddings"]) / orig
    return out

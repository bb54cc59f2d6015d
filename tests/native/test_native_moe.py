"""Mixtures of experts on the native runner (csrc/moe_impl.h, runlm/models/native_moe.py): Mixtral, Qwen2-MoE
(its gated shared expert), Qwen3-MoE, OLMoE (unnormalized top-k, whole-projection q/k norms) and gpt-oss (attention
sinks, alternating sliding-window layers, the router's and experts' biases, the clamped SwiGLU) from llama.cpp's
converter, q8_0 (the native runner takes no fp32 matrices), against the torch fast path on the same file. The
experts' matrices go through the same block kernels and the fp32 router through linear.cpp's reduction order,
but the softmax, the experts' SiLU and the shared expert's sigmoid are our C++'s rather than torch's vectorized
exp: logprobs are held to 1e-4 nats (on these files they come out identical), greedy tokens must be the same."""
from __future__ import annotations

import numpy as np
import pytest

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from runlm.native import kernels
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.native.test_native_runner import _engines

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are unavailable here")

IDS = [[5, 17, 99, 3, 250, 41, 7], [900, 12, 12, 4000, 77], [31, 8, 1500, 2, 64, 19, 600, 3]]
TOLERANCE = 1e-4  # on each returned logprob, in nats


def _run(llm: LLM, ids: list[list[int]], n: int = 8) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    return llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)


def _logprobs(out) -> np.ndarray:
    """Every returned logprob of a request (generated tokens' top 5 and the prompt's top 3), in a fixed order."""
    values = [lp.logprob for step in out.outputs[0].logprobs for _, lp in sorted(step.items())]
    values += [lp.logprob for step in out.prompt_logprobs if step for _, lp in sorted(step.items())]
    return np.array(values)


@default_run("qwen2-moe", "gpt-oss")
@pytest.mark.parametrize("recipe", ["mixtral", "qwen2-moe", "qwen3-moe", "olmoe", "gpt-oss"])
def test_experts_match_the_torch_fast_path(recipe: str) -> None:
    native, fused = _engines(str(converted_gguf(recipe, "q8_0")))
    a, b = _run(native, IDS), _run(fused, IDS)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        lx, ly = _logprobs(x), _logprobs(y)
        assert lx.shape == ly.shape and np.abs(lx - ly).max() < TOLERANCE


def _layer0(recipe: str):
    """(config, gguf, layer 0's Experts) of a test model's q8_0 file."""
    from runlm.formats.gguf import GGUFFile
    from runlm.models.config import ModelConfig
    from runlm.models.native import _linear
    from runlm.models.native_moe import layer_experts

    gguf = GGUFFile(converted_gguf(recipe, "q8_0"))
    cfg = ModelConfig.from_gguf(gguf)
    return cfg, gguf, layer_experts(gguf, cfg, 0, lambda names, cols: _linear(gguf, names, cols))


def _reference(cfg, gguf, x: np.ndarray) -> np.ndarray:
    """SparseMoeBlock's formula in float64 numpy on the dequantized experts: an independent check of the op."""
    t = lambda name: gguf.load_array(f"blk.0.{name}.weight").astype(np.float64)  # noqa: E731
    router, gate, up, down = t("ffn_gate_inp"), t("ffn_gate_exps"), t("ffn_up_exps"), t("ffn_down_exps")
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    logits = x @ router.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for r in range(x.shape[0]):
        chosen = np.argsort(-probs[r], kind="stable")[:cfg.num_experts_per_tok]
        w = probs[r, chosen] / (probs[r, chosen].sum() if cfg.norm_topk_prob else 1.0)
        for e, we in zip(chosen, w, strict=True):
            out[r] += we * (down[e] @ (silu(gate[e] @ x[r]) * (up[e] @ x[r])))
    if "blk.0.ffn_up_shexp.weight" in gguf.tensors:
        g = 1 / (1 + np.exp(-(x @ t("ffn_gate_inp_shexp").reshape(-1))))
        out += g[:, None] * ((silu(x @ t("ffn_gate_shexp").T) * (x @ t("ffn_up_shexp").T)) @ t("ffn_down_shexp").T)
    return out, probs


@pytest.mark.parametrize("recipe", ["qwen2-moe", "olmoe"])
def test_a_batch_of_rows_on_different_experts_equals_each_row_alone(recipe: str) -> None:
    """16 rows that between them pick most experts: the batched op gives each row's own result to the bit (rows
    grouped per expert never mix), and both are SparseMoeBlock's formula up to the activations' int8 rounding."""
    cfg, gguf, experts = _layer0(recipe)
    x = np.random.default_rng(0).standard_normal((16, cfg.hidden_size)).astype(np.float32)
    batched = experts.forward(x, np.empty_like(x))
    alone = np.concatenate([experts.forward(x[i:i + 1], np.empty_like(x[i:i + 1])) for i in range(len(x))])
    np.testing.assert_array_equal(batched, alone)
    want, probs = _reference(cfg, gguf, x.astype(np.float64))
    firsts = {int(np.argmax(p)) for p in probs}
    assert len(firsts) >= 3, f"the rows should route differently, all went to {firsts}"
    assert np.abs(batched - want).max() < 0.02 * np.abs(want).max()


def test_bad_experts_are_refused() -> None:
    from runlm.native.moe import Experts

    cfg, gguf, experts = _layer0("mixtral")
    gate = (gguf.raw("blk.0.ffn_gate_exps.weight"), experts._keep[1][1])
    down = (gguf.raw("blk.0.ffn_down_exps.weight"), experts._keep[3][1])
    router = np.zeros((cfg.num_experts, cfg.hidden_size), dtype=np.float32)
    args = dict(experts=cfg.num_experts, renormalize=True, hidden=cfg.hidden_size, inner=cfg.expert_size,
                router=router, router_type=0, gate=gate, up=gate, down=down)
    with pytest.raises(ValueError, match="top_k"):
        Experts(top_k=cfg.num_experts + 1, **args)
    with pytest.raises(ValueError, match="gate holds"):  # a merged gate_up must be twice as tall
        Experts(top_k=2, **{**args, "up": None})
    with pytest.raises(ValueError, match="act"):
        Experts(top_k=2, act="relu", **args)
    x = np.zeros((2, cfg.hidden_size + 1), dtype=np.float32)
    with pytest.raises(ValueError, match="shape"):
        experts.forward(x, np.empty_like(x))


def test_gpt_oss_sinks_on_the_packed_kv_cache() -> None:
    """The native default cache (fp16 rows) takes the attention sinks as the fp32 cache does: the prompt's logprobs
    within fp16 K/V's rounding on these random-weight models (0.49 nats at most here; Llama's file: 0.68), where the
    same step without its sinks is off by 4.9-10.8 nats."""
    path = str(converted_gguf("gpt-oss", "q8_0"))
    kw = dict(block_size=16, max_num_batched_tokens=64, kv_cache_memory="64MiB", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, prompt_logprobs=3)
    exact, packed = (LLM(path, kv_cache_dtype=dtype, **kw).generate([{"prompt_token_ids": i} for i in IDS], params,
                                                                     use_tqdm=False) for dtype in ("fp32", "fp16"))
    for x, y in zip(packed, exact, strict=True):
        assert np.abs(_logprobs(x) - _logprobs(y)).max() < 1.0


def test_the_engine_batch_equals_each_request_alone() -> None:
    """Prompts whose tokens route to different experts, in one batch and one by one: the same tokens and logprobs."""
    native = LLM(str(converted_gguf("qwen3-moe", "q8_0")), block_size=16, max_num_batched_tokens=64,
                 kv_cache_memory="64MiB", max_model_len=512)
    assert native.engine.native
    together = _run(native, IDS)
    for ids, batched in zip(IDS, together, strict=True):
        (alone,) = _run(native, [ids])
        assert alone.outputs[0].token_ids == batched.outputs[0].token_ids
        np.testing.assert_array_equal(_logprobs(alone), _logprobs(batched))

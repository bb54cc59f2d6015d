"""Families beyond Llama (Gemma 2 and 3, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers,
from safetensors and from GGUF.

Each generated model (tests/fixtures/models.py, FAMILY_RECIPES) is checked as test_llama.py checks the
Llama family: exact mode's last-position logits within 1e-4 relative of transformers' and 64 greedy
tokens through the engine equal to transformers' greedy. The GGUF files are the same models written by
llama.cpp's own converter (tests/fixtures/gguf_convert.py), compared against transformers on the
safetensors source they were converted from. Fast mode (GGUF blocks as stored, 8-bit activations) is held
to llama.cpp's KL divergence against exact mode on the converter's Q8_0 file.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from runlm.kernels import ggml
from runlm.models.evaluate import all_logits, english_text, mean_kl
from runlm.models.linear import Linear
from runlm.models.load import LoadedModel, load_decoder
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.fixtures.models import FAMILY_RECIPES, RECIPES
from tests.models.test_llama import _check, _prompt

# Fast mode is held to llama.cpp's own numerics on the same file: mean KL of the next-token distribution
# against exact mode on the converter's f32 file, over the first 512 tokens of english_text(), for the
# converter's Q8_0 file. llama.cpp's figures (llama-cpp-python 0.3.36, logits_all, one context) are below;
# its logits on the f32 files agree with exact mode's to KL <= 2e-4. runlm measured: gemma2 0.00171,
# gemma3 0.00170, mixtral 0.203, qwen2-moe 0.096, qwen3-moe 0.084, olmoe 0.082. The mixtures' large
# figures are the random routers': a token whose top-k experts nearly tie flips expert under any rounding,
# in llama.cpp as in runlm. llama.cpp cannot read the phi3 test file's substituted BPE vocabulary; runlm
# measures 0.031 there (exact mode on the Q8_0 weights alone: 0.019), so its bound is absolute.
LLAMA_CPP_Q8_0_KL = {"gemma2": 0.00173, "gemma3": 0.00169, "mixtral": 0.209, "qwen2-moe": 0.104,
                     "qwen3-moe": 0.0804, "olmoe": 0.0862}
FAST_KL_BOUND = {**{r: 1.25 * kl for r, kl in LLAMA_CPP_Q8_0_KL.items()}, "phi3": 0.06}
KL_POSITIONS = 512


def _reference(source: Path):
    # eager: the attention that soft-caps scores (SDPA ignores Gemma 2's attn_logit_softcapping)
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="eager").eval()


def matches_transformers(recipe: str, fmt: str, tiny_model) -> LoadedModel:
    """The recipe's model in exact mode, from its directory (``fmt`` "safetensors") or the GGUF file llama.cpp's
    converter writes of it ("gguf"), checked against transformers on the directory (tests.models.test_llama's
    _check: logits within 1e-4 relative, greedy tokens through the engine); returned for the family's own asserts."""
    source = tiny_model(recipe)
    loaded = load_decoder(source if fmt == "safetensors" else converted_gguf(recipe), exact_numerics=True)
    _check(loaded, _reference(source), _prompt(loaded.config.vocab_size, 200))
    return loaded


@pytest.mark.parametrize("recipe", FAMILY_RECIPES)
def test_safetensors_match_transformers(recipe: str, tiny_model) -> None:
    path = tiny_model(recipe)
    loaded = load_decoder(path, exact_numerics=True)
    assert loaded.config.family == recipe.replace("-", "_")
    _check(loaded, _reference(path), _prompt(loaded.config.vocab_size, 200))


# (the default run: Gemma 3's KV groups and Qwen3-MoE's experts; every family under make test-slow)
@pytest.mark.parametrize("recipe", [r if r in ("gemma3", "qwen3-moe") else pytest.param(r, marks=pytest.mark.slow)
                                    for r in FAMILY_RECIPES])
def test_gguf_from_llama_cpps_converter_matches_transformers(recipe: str, tiny_model) -> None:
    path = converted_gguf(recipe)
    loaded = load_decoder(path, exact_numerics=True)
    assert loaded.config.family == recipe.replace("-", "_")
    _check(loaded, _reference(tiny_model(recipe)), _prompt(loaded.config.vocab_size, 200))


@default_run("gemma3", "qwen3-moe")
@pytest.mark.skipif(not ggml.available(), reason="ggml's kernels are unavailable: fast mode is exact mode here")
@pytest.mark.parametrize("recipe", FAMILY_RECIPES)
def test_fast_mode_kl_divergence_from_exact_mode(recipe: str) -> None:
    fast = load_decoder(converted_gguf(recipe, "q8_0"))
    # computed on the file's blocks (routers excepted: the converter keeps them F32)
    linears = [m for name, m in fast.model.named_modules() if isinstance(m, Linear)
               and not name.endswith((".mlp.gate", ".shared_expert_gate"))]
    assert linears and all(m.ggml and m.weight is None for m in linears)
    kl = fast_mode_kl(recipe, fast)
    assert 0 < kl < FAST_KL_BOUND[recipe], f"fast mode's KL divergence {kl:.6f}"


def fast_mode_kl(recipe: str, fast: LoadedModel | None = None) -> float:
    """Fast mode on the recipe's Q8_0 file from llama.cpp's converter (``fast``, when loaded already) against exact
    mode on its f32 file: the mean KL of the next-token distributions over the first KL_POSITIONS tokens of
    english_text(), the figure llama.cpp's own is measured by."""
    fast = fast or load_decoder(converted_gguf(recipe, "q8_0"))
    exact = load_decoder(converted_gguf(recipe), exact_numerics=True)
    ids = exact.tokenizer.encode(english_text())[:KL_POSITIONS]
    return mean_kl(all_logits(exact.model, ids), all_logits(fast.model, ids))


@pytest.mark.skipif(not ggml.available(), reason="ggml's kernels are unavailable: fast mode is exact mode here")
@pytest.mark.parametrize("recipe", [*FAMILY_RECIPES, "deepseek-v3"])  # (and latent attention's cache)
def test_engine_fast_mode_is_batch_invariant_and_reuses_prefixes(recipe: str) -> None:
    llm = LLM(str(converted_gguf(recipe, "q8_0")), block_size=4, max_num_batched_tokens=64,
              kv_cache_memory="64MiB", max_model_len=1024)
    prompts = [{"prompt_token_ids": _prompt(49152, n, seed=n)} for n in (40, 90, 150)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    together = llm.generate(prompts, params)
    for prompt, out in zip(prompts, together):
        alone = llm.generate([prompt], params)[0].outputs[0]  # the prompt's blocks now come from the prefix cache
        assert alone.token_ids == out.outputs[0].token_ids
        assert alone.logprobs == out.outputs[0].logprobs


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_longrope_switches_from_short_to_long_factors_as_transformers_does(fmt: str, tiny_model) -> None:
    """A 40-token prompt is rotated with the short factors; greedy decoding passes the 64 original positions,
    after which new tokens use the long ones (cached keys keep their rotation, as in transformers)."""
    source = tiny_model("phi3")
    loaded = load_decoder(source if fmt == "safetensors" else converted_gguf("phi3"), exact_numerics=True)
    rope = loaded.model.model.rope
    assert rope.long is not None and rope.long_after == 64 and rope.rotary_dim == 8
    _check(loaded, _reference(source), _prompt(loaded.config.vocab_size, 40))


MOE_RECIPES = ("mixtral", "qwen2-moe", "qwen3-moe", "olmoe")


@pytest.mark.skipif(not ggml.available(), reason="ggml's kernels are unavailable: fast mode is exact mode here")
@pytest.mark.parametrize("recipe", MOE_RECIPES)
def test_stacked_gguf_experts_stay_quantized_views_of_the_file(recipe: str) -> None:
    path = converted_gguf(recipe, "q8_0")
    loaded = load_decoder(path)
    cfg, block = loaded.config, loaded.model.model.layers[0].mlp
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2 and len(block.experts) == 8
    raws = [m.ggml[0].raw for e in block.experts for m in (e.gate_up_proj, e.down_proj)]
    assert all(m.weight is None for e in block.experts for m in (e.gate_up_proj, e.down_proj))
    stacked = loaded.model.weight_tensors()
    assert sum(t.numel() * t.element_size() for t in stacked) <= path.stat().st_size  # the file's own bytes
    assert len({r.data_ptr() for r in raws}) == len(raws)  # one view per expert and projection
    assert cfg.num_active_params < cfg.num_params


def test_routing_reads_each_chosen_expert_once_per_step(tiny_model, monkeypatch) -> None:
    """Tokens are grouped by expert: a batch calls each chosen expert once, with all of its tokens."""
    from runlm.models.attention import ForwardContext, forward_context

    loaded = load_decoder(tiny_model("qwen3-moe"), exact_numerics=True)
    block = loaded.model.model.layers[0].mlp
    calls: list[int] = []
    for i, expert in enumerate(block.experts):
        forward = expert.forward
        monkeypatch.setattr(expert, "forward", lambda x, i=i, f=forward: (calls.append(i), f(x))[1])
    ids = _prompt(loaded.config.vocab_size, 64)
    with torch.inference_mode(), forward_context(ForwardContext.no_cache([64])):
        loaded.model(torch.tensor(ids), torch.arange(64))
    assert sorted(calls) == sorted(set(calls)) and len(calls) > 2


@pytest.mark.parametrize("recipe", MOE_RECIPES)
def test_memory_estimates_count_every_expert_and_show_reports_them(recipe: str, tiny_model) -> None:
    from runlm.store.inspect import inspect_model

    source = tiny_model(recipe)
    loaded = load_decoder(source, exact_numerics=True)
    header = inspect_model(source)
    assert loaded.config.num_params == header.parameters == sum(p.numel() for p in loaded.model.parameters())
    assert loaded.config.num_active_params < loaded.config.num_params
    assert (header.experts, header.experts_used) == (8, 2)
    path = converted_gguf(recipe, "q8_0")
    info = inspect_model(path)
    assert (info.experts, info.experts_used) == (8, 2)
    # the stacked expert tensors are matrices computed on as stored: counted at their size in the file
    from runlm.formats.gguf import GGUFFile

    experts = [t for name, t in GGUFFile(path).tensors.items() if "_exps." in name]
    assert len(experts) == 3 * loaded.config.num_layers
    assert info.stored_matrix_bytes >= sum(t.n_bytes for t in experts)
    assert info.stored_matrix_params >= sum(t.n_values for t in experts)


# MiniMax's checkpoints also store its lightning attention's decays (buffers that follow from each layer's depth), which
# the store counts as tensors of the file; tests/models/test_mamba2.py counts its parameters against transformers'
@pytest.mark.parametrize("recipe", sorted(set(RECIPES) - {"minimax"}))
def test_config_counts_the_checkpoints_parameters(recipe: str, tiny_model) -> None:
    import json

    from runlm.models.config import ModelConfig
    from runlm.store.inspect import inspect_model

    path = tiny_model(recipe)
    assert ModelConfig.from_hf(json.loads((path / "config.json").read_text())).num_params == \
        inspect_model(path).parameters


def test_unsupported_architectures_are_refused_with_every_supported_one_listed(tmp_path: Path) -> None:
    import json

    import gguf as gguf_py

    from runlm.formats import ModelFormatError
    from runlm.formats.architectures import DECODER_GGUF_ARCHS, DECODER_HF_ARCHS

    path = tmp_path / "falcon.gguf"
    writer = gguf_py.GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFormatError, match="'falcon' is not supported") as err:
        load_decoder(path)
    assert all(arch in str(err.value) for arch in DECODER_GGUF_ARCHS)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ModelFormatError, match="'FalconForCausalLM' is not a supported decoder") as err:
        load_decoder(tmp_path / "hf")
    assert all(arch in str(err.value) for arch in [*DECODER_GGUF_ARCHS, *DECODER_HF_ARCHS])


@pytest.mark.skipif(not ggml.available(), reason="ggml's kernels are unavailable: fast mode is exact mode here")
@pytest.mark.parametrize("recipe", FAMILY_RECIPES)
def test_half_precision_safetensors_are_computed_on_as_stored(recipe: str, tiny_model, tmp_path: Path) -> None:
    """Fast mode on a bf16 checkpoint: every matrix (fused Phi-3 ones, each expert) is a view of the file."""
    import shutil

    from gguf import GGMLQuantizationType

    from runlm.models.evaluate import all_logits

    source = tiny_model(recipe)
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(tmp_path)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp_path / f.name)
    fast, exact = load_decoder(tmp_path), load_decoder(tmp_path, exact_numerics=True)
    linears = [m for m in fast.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and {s.qtype for s in m.ggml} == {GGMLQuantizationType.BF16}
                           for m in linears)
    ids = _prompt(49152, 64)
    ours, reference = all_logits(fast.model, ids), all_logits(exact.model, ids)
    # x rounded to bf16 is the only change; in a mixture it may flip a near-tied expert at a position or two
    # (OLMoE: one of 64 positions, the median 0.009)
    per_position = (ours - reference).norm(dim=-1) / reference.norm(dim=-1)
    assert float(per_position.median()) < 0.05 and float((per_position > 0.1).float().mean()) < 0.1


def _windowed_mistral(tiny_model, tmp_path: Path, window: int) -> Path:
    import json
    import shutil

    path = tmp_path / f"mistral-window-{window}"
    shutil.copytree(tiny_model("mistral"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": window}))
    return path


def test_sliding_window_blocks_are_given_back_and_outputs_stay_transformers(tiny_model, tmp_path: Path,
                                                                           monkeypatch) -> None:
    """Every layer windowed (16 positions, blocks of 4): a sequence holds ~window/block_size blocks however long
    it runs, and greedy decoding still equals transformers' with chunked prefill, six sequences sharing a
    small cache, and a prefix-cache hit on blocks given back. (Preemption gives a table back whole, holes skipped:
    tests/engine/test_kv_cache.py.)"""
    from runlm.engine.core.kv_cache import BlockManager

    path = _windowed_mistral(tiny_model, tmp_path, 16)
    ref = _reference(path)
    held: list[int] = []
    release = BlockManager.release_outside_window

    def spy(self, table, num_computed):
        release(self, table, num_computed)
        held.append(len(table.blocks) - table.num_released)

    monkeypatch.setattr(BlockManager, "release_outside_window", spy)
    loaded = load_decoder(path, exact_numerics=True)
    _check(loaded, ref, _prompt(loaded.config.vocab_size, 200))  # one 200-token prefill, then 64 decode steps
    assert max(held) <= 16 // 4 + 2

    prompts = [_prompt(loaded.config.vocab_size, n, seed=n) for n in (150, 150, 90, 120, 60, 180)]
    llm = LLM(str(path), block_size=4, kv_cache_memory="96KiB", max_num_batched_tokens=64, max_model_len=1024,
              exact_numerics=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    from tests.models.test_llama import _reference_greedy

    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _reference_greedy(ref, prompt)[:40]
    roomy = LLM(str(path), block_size=4, kv_cache_memory="1MiB", max_model_len=1024, exact_numerics=True)
    first, again = (roomy.generate([{"prompt_token_ids": prompts[0]}], params)[0] for _ in range(2))
    # the prompt's blocks were given back as it ran but stay cached: the second run takes them back
    assert again.num_cached_tokens >= 140 and again.outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("recipe", ["gemma2", "gemma3"])
def test_window_layers_give_blocks_back_beside_global_ones_and_outputs_stay_transformers(recipe: str, tiny_model,
                                                                                       monkeypatch) -> None:
    """Gemma's local layers (window 16, blocks of 4) keep their own blocks: they hold ~window/block_size of them
    however long a sequence runs while the global layers hold the whole context, and greedy decoding still
    equals transformers' with chunked prefill, six sequences sharing a small cache, and prefix-cache hits."""
    from runlm.engine.core.kv_cache import BlockManager
    from runlm.engine.core.kv_groups import HybridBlockManager
    from tests.models.test_llama import _reference_greedy

    path = tiny_model(recipe)
    ref = _reference(path)
    held: dict[int | None, list[int]] = {None: [], 16: []}
    release = BlockManager.release_outside_window

    def spy(self, table, num_computed):
        release(self, table, num_computed)
        held[self.window].append(len(table.blocks) - table.num_released)

    monkeypatch.setattr(BlockManager, "release_outside_window", spy)
    vocab = load_decoder(path, exact_numerics=True).config.vocab_size
    prompts = [_prompt(vocab, n, seed=n) for n in (150, 150, 90, 120, 60, 180)]
    # a cache too small for all six at once (preemption), the window group sized for 8 running sequences
    memory = {"gemma2": "256KiB", "gemma3": "512KiB"}[recipe]
    llm = LLM(str(path), block_size=4, kv_cache_memory=memory, max_num_batched_tokens=64, max_num_seqs=8,
              max_model_len=1024, exact_numerics=True)
    blocks = llm.engine.blocks
    assert isinstance(blocks, HybridBlockManager)
    # the window group is sized for windows, and the budget it leaves goes to the global group
    assert len(blocks.groups[1].blocks) < len(blocks.groups[0].blocks)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _reference_greedy(ref, prompt)[:40]
    assert max(held[16]) <= 16 // 4 + 2 and max(held[None]) >= 180 // 4 and llm.engine.num_preemptions > 0
    roomy = LLM(str(path), block_size=4, kv_cache_memory="2MiB", max_model_len=1024, exact_numerics=True)
    first, again = (roomy.generate([{"prompt_token_ids": prompts[0]}], params)[0] for _ in range(2))
    # the local layers' blocks were given back as the prompt ran but stay cached: both groups hit
    assert again.num_cached_tokens >= 140 and again.outputs[0].token_ids == outs[0].outputs[0].token_ids

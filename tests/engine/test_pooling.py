"""Pooling requests through the engine: decoder embedders and rerankers against transformers,
batching by the scheduler, AsyncLLM.encode, and the errors a caller can make."""
from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from runlm.engine.async_llm import AsyncLLM
from runlm.engine.llm import LLM
from runlm.engine.types.errors import PromptError, TaskError
from runlm.engine.types.pooling_params import PoolingParams, PoolingParamsError
from runlm.engine.types.sampling_params import SamplingParams
from tests.models.sentences import varied_sentences

TEXTS = ["Hello there, general Kenobi.", "a", "The quick brown fox jumps over the lazy dog. " * 12,
         "Ünïcödé 中文 😀", "def f(x): return x * 2"]


def _transformers_last_token(path, texts: list[str]) -> torch.Tensor:
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(str(path)), AutoModel.from_pretrained(str(path)).eval()
    with torch.no_grad():  # one text at a time: the last position is the last token, no padding involved
        return torch.stack([model(**tok(t, return_tensors="pt")).last_hidden_state[0, -1] for t in texts])


@pytest.fixture(scope="module")
def qwen3_embedder(tiny_model) -> LLM:
    return LLM(str(tiny_model("qwen3-embedding")), max_num_batched_tokens=256)


@pytest.mark.parametrize("recipe", ["qwen3-embedding", "llama-embedding"])
def test_decoder_embedder_matches_transformers(tiny_model, recipe: str) -> None:
    path = tiny_model(recipe)
    llm = LLM(str(path))
    assert llm.get_supported_tasks() == ("embed",)
    ours = torch.stack([o.outputs.data for o in llm.embed(TEXTS, use_tqdm=False)])
    ref = F.normalize(_transformers_last_token(path, TEXTS), dim=-1)
    assert torch.allclose(ours, ref, atol=1e-5)


def test_generating_decoder_embeds_when_asked(tiny_model) -> None:
    path = tiny_model("qwen2")
    llm = LLM(str(path), task="embed")
    ours = llm.embed(TEXTS[:2], use_tqdm=False)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(str(path)), AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        ref = [model(**tok(t, return_tensors="pt"), output_hidden_states=True).hidden_states[-1][0, -1]
               for t in TEXTS[:2]]
    for o, r in zip(ours, ref):
        assert torch.allclose(o.outputs.data, F.normalize(r, dim=-1), atol=1e-5)


def test_decoder_reranker_matches_transformers(tiny_model) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tiny_model("qwen3-reranker")
    llm = LLM(str(path))
    assert llm.get_supported_tasks() == ("classify", "score")
    query, docs = "what is a fox", TEXTS
    ours = torch.tensor([o.outputs.score for o in llm.score(query, docs, use_tqdm=False)])
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    with torch.no_grad():
        ref = torch.stack([torch.sigmoid(model(**tok(query, d, return_tensors="pt")).logits[0, 0]) for d in docs])
    assert torch.allclose(ours, ref, atol=1e-5)


def test_batched_equals_one_at_a_time(qwen3_embedder: LLM) -> None:
    texts = varied_sentences(30, seed=3)
    together = torch.stack([o.outputs.data for o in qwen3_embedder.embed(texts, use_tqdm=False)])
    alone = torch.stack([qwen3_embedder.embed(t, use_tqdm=False)[0].outputs.data for t in texts])
    assert torch.allclose(together, alone, atol=1e-5)


def test_scheduler_batches_under_the_sequence_limit(tiny_model) -> None:
    llm = LLM(str(tiny_model("bert")), max_num_seqs=3)
    engine = llm.engine
    for i in range(7):
        engine.add_request(str(i), f"sentence number {i}")
    sizes = []
    while engine.has_unfinished_requests():
        sizes.append(len(engine.step()))
    assert sizes == [3, 3, 1]
    assert engine.blocks.num_free_blocks == len(engine.blocks.blocks)  # nothing held between steps


def test_scheduler_batches_under_the_token_budget(tiny_model) -> None:
    llm = LLM(str(tiny_model("bert")), max_num_batched_tokens=64)  # the model's max_seq_length is 64
    engine = llm.engine
    ids = [101] + [2000] * 38 + [102]  # 40 tokens: one per 64-token step
    for i in range(3):
        engine.add_request(str(i), list(ids))
    assert [len(engine.step()) for _ in range(3)] == [1, 1, 1]


def test_budget_is_raised_to_hold_the_longest_prompt(tiny_model) -> None:
    llm = LLM(str(tiny_model("qwen3-embedding")), max_num_batched_tokens=16)
    assert llm.engine.scheduler.config.max_num_batched_tokens >= llm.engine.max_model_len
    out = llm.embed("word " * 100, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 16 and out.num_truncated_tokens == 0


def test_matryoshka_dimensions(qwen3_embedder: LLM) -> None:
    full = qwen3_embedder.embed(TEXTS[0], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.data
    short = qwen3_embedder.embed(TEXTS[0], PoolingParams(dimensions=32), use_tqdm=False)[0].outputs.data
    assert short.shape == (32,)
    assert torch.allclose(short, F.normalize(full[:32], dim=0), atol=1e-6)
    with pytest.raises(PoolingParamsError, match="more than"):
        qwen3_embedder.embed("x", PoolingParams(dimensions=65), use_tqdm=False)


def test_errors_are_clear(qwen3_embedder: LLM, tiny_model) -> None:
    minilm = LLM("minilm")
    with pytest.raises(PoolingParamsError, match="does not support shortened embeddings"):
        minilm.embed("x", PoolingParams(dimensions=100), use_tqdm=False)
    with pytest.raises(TaskError, match="cannot generate text"):
        minilm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(PromptError, match="empty"):
        minilm.embed(["fine", ""], use_tqdm=False)
    assert not minilm.engine.has_unfinished_requests()  # the good prompt before the bad one was withdrawn
    with pytest.raises(PromptError, match="outside the vocabulary"):
        minilm.embed([[101, 10**6, 102]], use_tqdm=False)
    with pytest.raises(PromptError, match="at most 256"):
        minilm.embed([[101] + [2000] * 300 + [102]], use_tqdm=False)
    kept = minilm.embed([[101] + [2000] * 300 + [102]], PoolingParams(truncate_prompt_tokens=10), use_tqdm=False)
    assert kept[0].prompt_token_ids == [2000] * 9 + [102] and kept[0].num_truncated_tokens == 292
    with pytest.raises(TaskError, match="supports embed, not 'score'"):
        minilm.encode({"text": "a", "text_pair": "b"}, PoolingParams(task="score"), use_tqdm=False)
    generator = LLM(str(tiny_model("qwen2")), kv_cache_memory="16MiB")
    with pytest.raises(TaskError, match="generates text"):
        generator.embed("hello", use_tqdm=False)


def test_score_with_an_embedding_model_is_cosine_similarity(qwen3_embedder: LLM) -> None:
    scores = qwen3_embedder.score("a query", ["a query", "something else entirely"], use_tqdm=False)
    a, b = (o.outputs.data for o in qwen3_embedder.embed(["a query", "something else entirely"], use_tqdm=False))
    assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    assert scores[1].outputs.score == pytest.approx(float(a @ b), abs=1e-5)


def test_async_encode_batches_concurrent_requests(tiny_model) -> None:
    path = str(tiny_model("bert"))
    texts = varied_sentences(12, seed=5)
    expected = [o.outputs.data for o in LLM(path).embed(texts, use_tqdm=False)]
    engine = AsyncLLM(path)
    assert engine.get_supported_tasks() == ("embed",)
    steps = 0
    step = engine.engine.step

    def counting_step():
        nonlocal steps
        steps += 1
        return step()
    engine.engine.step = counting_step

    async def one(i: int):
        outs = [o async for o in engine.encode(texts[i], PoolingParams(), request_id=f"r{i}")]
        assert len(outs) == 1 and outs[0].finished and outs[0].request_id == f"r{i}"
        return outs[0].outputs.data

    async def main():
        await engine.pause_generation(mode="wait")  # hold the requests so they arrive together
        tasks = [asyncio.create_task(one(i)) for i in range(len(texts))]
        await asyncio.sleep(0.2)
        await engine.resume_generation()
        return await asyncio.gather(*tasks)

    try:
        got = asyncio.run(main())
        with pytest.raises(TaskError):
            async def gen():
                return [o async for o in engine.generate("hi", SamplingParams(max_tokens=2))]
            asyncio.run(gen())
    finally:
        engine.shutdown()
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, atol=1e-5)
    assert steps == 1  # twelve requests, one batch


def test_yes_no_reranker_matches_transformers(tiny_model) -> None:
    """A causal LM with classifier_from_token: score = sigmoid(logit("yes") - logit("no")) at the last token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model("qwen3-yes-no-reranker")
    llm = LLM(str(path))
    assert llm.get_supported_tasks() == ("classify", "score")
    query, docs = "is a fox quick", TEXTS[:3]
    ours = torch.tensor([o.outputs.score for o in llm.score(query, docs, use_tqdm=False)])
    tok, model = AutoTokenizer.from_pretrained(str(path)), AutoModelForCausalLM.from_pretrained(str(path)).eval()
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    with torch.no_grad():
        logits = torch.stack([model(**tok(query, d, return_tensors="pt")).logits[0, -1] for d in docs])
    assert torch.allclose(ours, torch.sigmoid(logits[:, yes] - logits[:, no]), atol=1e-5)

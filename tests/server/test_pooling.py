"""Embeddings, rerank and score over a real ``runlm serve-engine`` process, through the official
``openai`` client and plain HTTP, against sentence-transformers and transformers."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from tests.models.sentences import varied_sentences
from tests.server.process import ServerProcess


@pytest.fixture(scope="module")
def minilm_server():
    server = ServerProcess("minilm").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(minilm_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=minilm_server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def test_openai_client_embeddings_equal_sentence_transformers(client, reference) -> None:
    texts = varied_sentences(200, seed=7)  # some past minilm's 256 tokens
    # the client asks for base64 by default; longer inputs are cut only when asked (-1: to the model's length)
    res = client.embeddings.create(model="minilm", input=texts, extra_body={"truncate_prompt_tokens": -1})
    ours = torch.tensor([d.embedding for d in res.data])
    ref = torch.from_numpy(reference.encode(texts))
    assert [d.index for d in res.data] == list(range(200))
    assert F.cosine_similarity(ours, ref).min().item() >= 0.99999
    counts = [len(ids) for ids in reference.tokenizer(texts, truncation=True, max_length=256)["input_ids"]]
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(counts)
    single = client.embeddings.create(model="minilm", input=texts[0], encoding_format="float")
    assert torch.allclose(torch.tensor(single.data[0].embedding), ours[0], atol=1e-5)


def test_long_input_is_truncated_when_asked_and_usage_says_so(client, reference) -> None:
    long = "word " * 600
    with pytest.raises(openai.BadRequestError):  # OpenAI and vLLM refuse it unless truncation is asked for
        client.embeddings.create(model="minilm", input=[long, "short"])
    res = client.embeddings.create(model="minilm", input=[long, "short"], extra_body={"truncate_prompt_tokens": -1})
    assert res.usage.model_extra["truncated_inputs"] == 1
    assert res.usage.model_extra["truncated_tokens"] == 602 - 256
    ref = torch.from_numpy(reference.encode([long]))[0]
    assert F.cosine_similarity(torch.tensor(res.data[0].embedding), ref, dim=0).item() >= 0.99999


def test_token_id_inputs(client, reference) -> None:
    text = "Token ids go straight to the model."
    ids = reference.tokenizer(text)["input_ids"]
    by_text = client.embeddings.create(model="minilm", input=text).data[0].embedding
    one = client.embeddings.create(model="minilm", input=ids)
    many = client.embeddings.create(model="minilm", input=[ids, ids[:4]])
    assert torch.allclose(torch.tensor(one.data[0].embedding), torch.tensor(by_text), atol=1e-6)
    assert len(many.data) == 2 and many.usage.prompt_tokens == len(ids) + 4


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["ok", ""]}, "input"),
    ({"input": [[101, 102], []]}, "input"), ({"input": ["x"] * 257}, "input"), ({"input": 5}, "input"),
    ({"input": "x", "dimensions": 100}, "dimensions"), ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": [[101, 999999, 102]]}, "input"), ({"input": [101] * 300}, "input"),
])
def test_bad_embedding_requests_get_a_clear_400(minilm_server, body: dict, param: str) -> None:
    res = _post(minilm_server, "/v1/embeddings", {"model": "minilm", **body})
    assert res.status_code == 400, res.text
    err = res.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_generation_on_an_embedding_model_is_a_400(client, minilm_server) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="minilm", prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(f"{minilm_server.url}/health").status_code == 200


def test_rerank_with_an_embedding_model_orders_as_sentence_transformers(minilm_server, reference) -> None:
    from sentence_transformers import util

    query = "Where do llamas live?"
    docs = ["The llama is a South American camelid.", "Pandas live in China.", "Paris is in France.",
            "Guanacos, relatives of the llama, live in the Andes.", "Rust has a borrow checker."]
    ref = util.cos_sim(reference.encode(query, convert_to_tensor=True), reference.encode(docs, convert_to_tensor=True))[0]
    expected = sorted(range(len(docs)), key=lambda i: -ref[i].item())
    for path in ("/v1/rerank", "/rerank"):
        res = _post(minilm_server, path, {"model": "minilm", "query": query, "documents": docs})
        assert res.status_code == 200, res.text
        results = res.json()["results"]
        assert [r["index"] for r in results] == expected
        assert all(abs(r["relevance_score"] - ref[r["index"]].item()) < 1e-5 for r in results)
        assert results[0]["document"] == {"text": docs[expected[0]]}
    top = _post(minilm_server, "/v1/rerank", {"query": query, "documents": docs, "top_n": 2,
                                              "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == expected[:2] and "document" not in top["results"][0]
    assert top["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("body, param", [
    ({"query": "q"}, "documents"), ({"query": "q", "documents": []}, "documents"),
    ({"query": "", "documents": ["d"]}, "query"), ({"documents": ["d"]}, "query"),
    ({"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
])
def test_bad_rerank_requests_get_a_clear_400(minilm_server, body: dict, param: str) -> None:
    res = _post(minilm_server, "/v1/rerank", body)
    assert res.status_code == 400 and res.json()["error"]["param"] == param, res.text


def test_concurrent_requests_all_succeed(client) -> None:
    texts = varied_sentences(24, seed=9)
    cut = {"truncate_prompt_tokens": -1}  # some are longer than the model takes: cut, as asked (else a 400)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda t: client.embeddings.create(model="minilm", input=[t, t.upper()],
                                                                   extra_body=cut), texts))
    together = client.embeddings.create(model="minilm", input=texts, extra_body=cut)
    for res, expect in zip(results, together.data):
        assert torch.allclose(torch.tensor(res.data[0].embedding), torch.tensor(expect.embedding), atol=1e-5)


@pytest.fixture(scope="module")
def cross_encoder_server(tiny_model):
    server = ServerProcess(str(tiny_model("bert-cross-encoder")), ["--served-model-name", "ranker"]).start()
    yield server
    server.stop()


def test_cross_encoder_rerank_and_score_match_transformers(cross_encoder_server, tiny_model) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tiny_model("bert-cross-encoder")
    query, docs = "capital of france", ["Paris is the capital.", "Bananas.", "France is in Europe.", "capital"]
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    with torch.no_grad():
        ref = torch.sigmoid(model(**tok([query] * 4, docs, padding=True, return_tensors="pt")).logits[:, 0])
    res = _post(cross_encoder_server, "/rerank", {"model": "ranker", "query": query, "documents": docs})
    assert res.status_code == 200, res.text
    results = res.json()["results"]
    assert [r["index"] for r in results] == ref.argsort(descending=True).tolist()
    assert all(abs(r["relevance_score"] - ref[r["index"]].item()) < 1e-5 for r in results)
    score = _post(cross_encoder_server, "/v1/score", {"model": "ranker", "text_1": query, "text_2": docs}).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2, 3]
    assert torch.allclose(torch.tensor([d["score"] for d in score["data"]]), ref, atol=1e-5)
    pairwise = _post(cross_encoder_server, "/score", {"text_1": [query, query], "text_2": docs[:2]}).json()
    assert torch.allclose(torch.tensor([d["score"] for d in pairwise["data"]]), ref[:2], atol=1e-5)
    bad = _post(cross_encoder_server, "/v1/score", {"text_1": [query] * 2, "text_2": docs})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"
    emb = _post(cross_encoder_server, "/v1/embeddings", {"input": "x"})
    assert emb.status_code == 400 and emb.json()["error"]["code"] == "unsupported_task"


def test_embeddings_on_a_generative_model_is_a_400(smollm2_server) -> None:
    from tests.server.conftest import API_KEY

    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="smollm2", input="hello")
    assert err.value.code == "unsupported_task"


def test_matryoshka_dimensions_on_a_decoder_embedder(tiny_model) -> None:
    server = ServerProcess(str(tiny_model("qwen3-embedding")), ["--served-model-name", "qe"]).start()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        full = client.embeddings.create(model="qe", input="a text", encoding_format="float").data[0].embedding
        short = client.embeddings.create(model="qe", input="a text", dimensions=32).data[0].embedding
        assert len(full) == 64 and len(short) == 32
        assert torch.allclose(torch.tensor(short), F.normalize(torch.tensor(full[:32]), dim=0), atol=1e-5)
    finally:
        server.stop()


def test_serve_a_generating_decoder_as_an_embedder(tiny_model) -> None:
    server = ServerProcess(str(tiny_model("qwen2")), ["--task", "embed", "--served-model-name", "q"]).start()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        res = client.embeddings.create(model="q", input=["one", "two"])
        assert len(res.data) == 2 and len(res.data[0].embedding) == 64
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="q", prompt="hi", max_tokens=2)
    finally:
        server.stop()

"""BERT encoders against their references: sentence-transformers for minilm (the real model) and
for a generated sentence-transformers model, transformers for CLS pooling and the cross-encoder."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runlm.engine.llm import LLM
from tests.models.sentences import varied_sentences


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM("minilm")


def test_minilm_matches_sentence_transformers(minilm: LLM, minilm_dir) -> None:
    from sentence_transformers import SentenceTransformer

    texts = varied_sentences(200)
    ours = torch.stack([o.outputs.data for o in minilm.embed(texts, use_tqdm=False)])
    ref = torch.from_numpy(SentenceTransformer(str(minilm_dir), device="cpu").encode(texts, batch_size=32))
    cos = F.cosine_similarity(ours, ref)
    assert cos.min().item() >= 0.99999, f"worst sentence: {texts[int(cos.argmin())]!r} ({cos.min().item()})"
    assert ours.shape == (200, 384)
    assert torch.allclose(ours.norm(dim=1), torch.ones(200), atol=1e-5)  # minilm's Normalize module


def test_minilm_truncates_long_text_and_says_so(minilm: LLM) -> None:
    short, long = minilm.embed(["a short sentence", "word " * 600], use_tqdm=False)
    assert short.num_truncated_tokens == 0
    assert len(long.prompt_token_ids) == 256  # sentence_bert_config.json's max_seq_length
    assert long.num_truncated_tokens == 602 - 256  # [CLS] + 600 words + [SEP], less what was kept
    assert long.prompt_token_ids[0] == 101 and long.prompt_token_ids[-1] == 102  # [CLS] ... [SEP] kept


def test_generated_mean_pooling_model_matches_sentence_transformers(tiny_model) -> None:
    from sentence_transformers import SentenceTransformer

    path = tiny_model("bert")
    texts = varied_sentences(40, seed=1)
    ours = torch.stack([o.outputs.data for o in LLM(str(path)).embed(texts, use_tqdm=False)])
    ref = torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(texts))
    assert F.cosine_similarity(ours, ref).min().item() >= 0.99999


def test_cls_pooling_without_sentence_transformers_files(tiny_model) -> None:
    from transformers import AutoModel, AutoTokenizer

    path = tiny_model("bert-cls")
    texts = ["first sentence", "a second, longer sentence with more words in it", "x"]
    ours = torch.stack([o.outputs.data for o in LLM(str(path)).embed(texts, use_tqdm=False)])
    tok, model = AutoTokenizer.from_pretrained(str(path)), AutoModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        hidden = model(**tok(texts, padding=True, return_tensors="pt")).last_hidden_state
    ref = F.normalize(hidden[:, 0], dim=-1)  # vLLM's default for BERT: CLS, normalised
    assert torch.allclose(ours, ref, atol=1e-5)


def test_cross_encoder_matches_transformers(tiny_model) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tiny_model("bert-cross-encoder")
    query = "what is the capital of france"
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "France borders Spain. " * 50, "capital"]
    llm = LLM(str(path))
    assert llm.get_supported_tasks() == ("classify", "score")
    ours = torch.tensor([o.outputs.score for o in llm.score(query, docs, use_tqdm=False)])
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    with torch.no_grad():
        batch = tok([query] * len(docs), docs, padding=True, truncation=True, max_length=128, return_tensors="pt")
        ref = torch.sigmoid(model(**batch).logits[:, 0])
    assert torch.allclose(ours, ref, atol=1e-5)
    assert ours.argsort().tolist() == ref.argsort().tolist()

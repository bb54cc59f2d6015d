"""Embedders and rerankers through the GPU runner's Triton attention kernel (runlm.kernels.triton.backend.
VarlenAttention: the batch's own K/V as the paged kernel's cache in blocks of one position, one launch a layer for
the whole batch, causal for a decoder, both ways for BERT), as on CUDA; here under TRITON_INTERPRET=1 in child
processes: the same references the SDPA path is held to (test_pooling.py's decoder embedders and reranker against
transformers, test_bert.py's generated BERT models against sentence-transformers and transformers), and in this
file's own child the kernel taken and batch-independent."""
from __future__ import annotations

import pytest
import torch

from runlm.engine.llm import LLM
from tests.fixtures.models import ROOT
from tests.fixtures.triton_checks import INTERPRETING, run_interpreted
from tests.models.sentences import varied_sentences

interpreted_only = pytest.mark.skipif(not INTERPRETING, reason="runs in test_pooling_through_the_kernel's child")
# (the default run: this file's child; `make test-slow` adds the two files' reference checks through the kernel)


def test_pooling_through_the_kernel() -> None:
    run_interpreted(__file__)


@pytest.mark.slow
def test_the_references_hold_through_the_kernel() -> None:
    run_interpreted(str(ROOT / "tests" / "engine" / "test_pooling.py"), "-k", "matches_transformers")
    run_interpreted(str(ROOT / "tests" / "models" / "test_bert.py"), "-k",
                    "generated_mean_pooling or cls_pooling or cross_encoder")


@interpreted_only
@pytest.mark.parametrize("recipe", ["llama-embedding", "bert"])
def test_interpreted_batches_take_the_kernel(tiny_model, recipe: str) -> None:
    """The runner attends through the kernel; sentences of many lengths in one batch give each sentence's vector
    alone (1e-5), and the vectors are SDPA's (the same runner with the kernel turned off)."""
    llm = LLM(str(tiny_model(recipe)), max_num_batched_tokens=512)
    runner = llm.engine.runner
    assert runner.use_triton
    texts = [t for t in varied_sentences(14, seed=5) if len(t) < 200][:5]  # (the interpreter is slow on long ones)
    batched = torch.stack([o.outputs.data for o in llm.embed(texts, use_tqdm=False)])
    alone = torch.stack([llm.embed([t], use_tqdm=False)[0].outputs.data for t in texts[:3]])
    assert (batched[:3] - alone).abs().max() <= 1e-5
    runner.use_triton = False
    sdpa = torch.stack([o.outputs.data for o in llm.embed(texts, use_tqdm=False)])
    assert (batched - sdpa).abs().max() <= 1e-5

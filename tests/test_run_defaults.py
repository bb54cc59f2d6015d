"""`runlm run smollm2` with no sampling flags: the model's recommended settings from runlm's built-in catalogue
(SmolLM2-Instruct's model card, temperature 0.2 and top_p 0.9, with Ollama's default repeat penalty 1.1), under
which the 135M model answers without repeating whole sentences within 200 tokens. (At 0.2 / 0.9 alone it did,
in 4 of these 8 answers.)"""
from __future__ import annotations

import re

import pytest

from runlm.catalog import recommended_sampling
from runlm.cli.run import run_params
from tests.fixtures.models import smollm2_gguf

PROMPTS = ["Why is the sky blue?", "Tell me about Paris.", "Write a short story about a cat.",
           "Explain how a computer works."]


def repeated_sentences(text: str) -> list[str]:
    """Sentences (20 characters or more) that occur more than once."""
    sentences = [s.strip().lower() for s in re.split(r"[.!?\n]+", text) if len(s.strip()) >= 20]
    return sorted({s for s in sentences if sentences.count(s) > 1})


def test_runs_defaults_are_the_models_own() -> None:
    params = run_params({}, recommended_sampling("smollm2", smollm2_gguf()))
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.2, 0.9, 1.1)
    assert (params.top_k, params.max_tokens) == (40, 512)  # run's own, for what the model leaves open
    flagged = run_params({"temperature": 0.9}, recommended_sampling("smollm2", smollm2_gguf()))
    assert flagged.temperature == 0.9 and flagged.top_p == 0.9  # a flag wins over the model's


@pytest.mark.slow
def test_smollm2_at_runs_defaults_does_not_repeat_sentences_within_200_tokens() -> None:
    from dataclasses import replace

    from runlm.engine.factory import engine_config, engine_from_config
    from runlm.engine.llm import LLM

    llm = LLM(engine=engine_from_config(engine_config(smollm2_gguf(), max_num_seqs=len(PROMPTS))))
    base = run_params({}, recommended_sampling("smollm2", smollm2_gguf()))
    prompts = [{"prompt_token_ids": llm.encode_chat([{"role": "user", "content": p}])} for p in PROMPTS]
    for seed in (0, 1):
        outs = llm.generate(prompts, replace(base, max_tokens=200, seed=seed))
        for prompt, out in zip(PROMPTS, outs):
            text = out.outputs[0].text
            assert len(out.outputs[0].token_ids) > 50, text  # a real answer, not a stop at once
            assert not repeated_sentences(text), (prompt, seed, text)

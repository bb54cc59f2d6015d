"""`runlm run smollm2` with no sampling flags: the model's recommended settings from runlm's built-in catalogue,
greedy with DRY over the generated tokens (top_p 0.9 from SmolLM2-Instruct's card for a raised temperature), under
which the 135M model answers without repeating whole sentences within 200 tokens. DRY replaced a repetition
penalty of 1.1 that also penalised the prompt's words and pushed plain answers away; bench/answer_eval.py measures
the settings against plain greedy (runlm/catalog.py has the figures)."""
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
    assert (params.temperature, params.top_p, params.dry_multiplier) == (0.0, 0.9, 0.8)
    assert params.repetition_penalty == 1.0  # nothing that touches the prompt
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


def test_answer_eval_slice_defaults_answer_the_capital_question() -> None:
    """A tiny slice of bench/answer_eval.py: the question the old default penalty got wrong."""
    from bench.answer_eval import QUESTIONS, correct, settings
    from runlm.engine.factory import engine_config, engine_from_config
    from runlm.engine.llm import LLM
    from runlm.engine.types.sampling_params import SamplingParams

    llm = LLM(engine=engine_from_config(engine_config(smollm2_gguf(), max_num_seqs=2)))
    question = QUESTIONS[0][0]  # the capital of France, in one word
    prompt = {"prompt_token_ids": llm.encode_chat([{"role": "user", "content": question}])}
    answer = llm.generate([prompt], SamplingParams(**settings()["defaults"], max_tokens=24), use_tqdm=False)
    assert correct(question, answer[0].outputs[0].text), answer[0].outputs[0].text

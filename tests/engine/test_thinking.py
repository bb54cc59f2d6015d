"""The engine's part in reasoning: a thinking budget forces the closing tag into the sequence when spent, and a
grammar constrains only the answer after the thinking (generated Qwen3 model, Qwen3's chat template)."""
from __future__ import annotations

import json

import pytest

from runlm.engine.llm import LLM, encode_chat
from runlm.engine.types.sampling_params import SamplingParams
from runlm.engine.types.thinking_params import ThinkingParams
from tests.fixtures.models import qwen3_thinking_model

PREFILL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "<think>\nThe user asks"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(qwen3_thinking_model()), kv_cache_memory="32MiB")


def _thinking(llm: LLM, budget: int | None, inside: bool = True) -> ThinkingParams:
    tok = llm.engine.tokenizer
    return ThinkingParams(end_ids=tok.encode("</think>", add_special_tokens=False),
                          start_ids=tok.encode("<think>", add_special_tokens=False),
                          close_ids=tok.encode("\n</think>\n\n", add_special_tokens=False), inside=inside,
                          budget=budget)


def _prompt(llm: LLM) -> list[int]:
    return encode_chat(llm.engine.tokenizer, PREFILL, add_generation_prompt=False, continue_final_message=True)


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_a_spent_budget_forces_the_closing_tag_after_exactly_that_many_tokens(llm: LLM, budget: int) -> None:
    th = _thinking(llm, budget)
    params = SamplingParams(temperature=0, max_tokens=budget + 12, ignore_eos=True, thinking=th)
    out = llm.generate([{"prompt_token_ids": _prompt(llm)}], params)[0].outputs[0]
    assert out.token_ids[budget:budget + len(th.close_ids)] == th.close_ids
    assert len(out.token_ids) == budget + 12  # the answer goes on after the tag


def test_without_a_budget_nothing_is_forced(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = llm.generate([{"prompt_token_ids": _prompt(llm)}], params)[0].outputs[0].token_ids
    params.thinking = _thinking(llm, None)
    assert llm.generate([{"prompt_token_ids": _prompt(llm)}], params)[0].outputs[0].token_ids == plain


def test_the_grammar_starts_after_the_thinking(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=60, thinking=_thinking(llm, 5),
                            structured_outputs={"json": schema})
    out = llm.generate([{"prompt_token_ids": _prompt(llm)}], params)[0].outputs[0]
    thinking, _, answer = out.text.partition("</think>")
    assert thinking.strip()  # five unconstrained tokens, which a JSON grammar would not have allowed
    assert not thinking.lstrip().startswith("{")
    assert set(json.loads(answer)) == {"city"}


def test_a_grammar_lets_the_answer_open_with_thinking_or_not(llm: LLM) -> None:
    """The template did not open the thinking: the answer may start with <think> (then it is free until the
    budget closes it) or with what the grammar allows."""
    prompt = encode_chat(llm.engine.tokenizer, PREFILL[:1])
    tok = llm.engine.tokenizer
    think = tok.encode("<think>", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=40, thinking=_thinking(llm, 3, inside=False),
                            structured_outputs={"choice": ["Paris", "Lyon"]}, logit_bias={t: 100 for t in think})
    text = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].text
    assert text.startswith("<think>") and text.split("</think>")[-1].strip() in ("Paris", "Lyon")
    params.logit_bias = None
    params.thinking = _thinking(llm, 3, inside=False)
    assert llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].text in ("Paris", "Lyon")

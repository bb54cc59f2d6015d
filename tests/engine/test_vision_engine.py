"""Images through the whole engine, on each vision family's tiny model: a follow-up turn on the same image
runs no vision-tower work, chunked prefill never changes an answer, a text request's tokens do not depend on
an image request beside it, and every bad image is refused before anything is queued."""
from __future__ import annotations

import importlib.util

import pytest

from runlm import LLM, SamplingParams
from runlm.engine.types.errors import PromptError
from tests.fixtures.vlm import png_bytes, test_image, vlm_dir

FAMILIES = [f for f in ("gemma3", "idefics3", "qwen2_5_vl", "llava")
            if importlib.util.find_spec(f"runlm.models.vision.{f}") is not None
            and importlib.util.find_spec(f"tests.fixtures.vlm.{f}") is not None]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


def _chat(text: str, *images) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module", params=FAMILIES or [pytest.param("none", marks=pytest.mark.skip("no family yet"))])
def family(request: pytest.FixtureRequest) -> str:
    return request.param


def _llm(family: str, **kwargs) -> LLM:
    return LLM(str(vlm_dir(family)), block_size=4, kv_cache_memory="64MiB", max_model_len=2048, **kwargs)


def test_a_second_turn_on_the_same_image_runs_no_tower_work(family: str) -> None:
    llm = _llm(family)
    cache = llm.engine.encoder_cache
    picture = png_bytes(test_image(96, 64))
    first = llm.chat(_chat("What is this?", picture), GREEDY)[0]
    assert cache.images_encoded == 1 and cache.tower_calls == 1
    turn2 = [*_chat("What is this?", picture),
             {"role": "assistant", "content": first.outputs[0].text},
             {"role": "user", "content": "And its colour?"}]
    second = llm.chat(turn2, GREEDY)[0]
    assert cache.images_encoded == 1, "the follow-up turn ran the vision tower again"
    assert second.num_cached_tokens > 0  # the image's blocks came from the prefix cache
    llm.reset_mm_cache()
    llm.reset_prefix_cache()
    again = llm.chat(turn2, GREEDY)[0]
    assert cache.images_encoded == 2
    assert again.outputs[0].token_ids == second.outputs[0].token_ids


def test_another_image_is_another_prompt(family: str) -> None:
    llm = _llm(family)
    a = llm.chat(_chat("Describe.", png_bytes(test_image(96, 64, seed=1))), GREEDY)[0]
    b = llm.chat(_chat("Describe.", png_bytes(test_image(96, 64, seed=2))), GREEDY)[0]
    assert a.prompt_token_ids == b.prompt_token_ids  # the same placeholders...
    assert b.num_cached_tokens < len(b.prompt_token_ids) - 4  # ...but no block over the image is shared
    assert a.outputs[0].logprobs != b.outputs[0].logprobs  # and the answer reads the picture
    assert llm.engine.encoder_cache.images_encoded == 2


def test_chunked_prefill_never_changes_the_answer(family: str) -> None:
    messages = _chat("Describe both.", test_image(96, 64, seed=3), test_image(64, 96, seed=4))
    whole = _llm(family, max_num_batched_tokens=4096).chat(messages, GREEDY)[0]
    chunked = _llm(family, max_num_batched_tokens=8).chat(messages, GREEDY)[0]
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids
    for x, y in zip(chunked.outputs[0].logprobs, whole.outputs[0].logprobs):
        assert {k: v.logprob for k, v in x.items()} == pytest.approx({k: v.logprob for k, v in y.items()}, abs=1e-4)


def test_text_rows_do_not_depend_on_image_rows_beside_them(family: str) -> None:
    llm = _llm(family)
    text = {"prompt_token_ids": llm.get_tokenizer().encode("A plain question about nothing in particular")}
    alone = llm.generate([text], GREEDY)[0].outputs[0]
    llm.reset_prefix_cache()
    placeholder = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    picture = {"prompt_token_ids": llm.encode_chat(placeholder), "multi_modal_data": {"image": test_image()}}
    together = llm.generate([picture, text], GREEDY)[1].outputs[0]
    assert together.token_ids == alone.token_ids and together.logprobs == alone.logprobs


def test_bad_images_are_refused_before_anything_is_queued(family: str) -> None:
    llm = _llm(family, limit_mm_per_prompt={"image": 2})
    with pytest.raises(PromptError, match="not an image"):
        llm.chat(_chat("?", b"GIF89a but not really"), GREEDY)
    with pytest.raises(PromptError, match="truncated|decoded"):
        llm.chat(_chat("?", png_bytes(test_image())[:200]), GREEDY)
    with pytest.raises(PromptError, match="at most 2"):
        llm.chat(_chat("?", *[test_image()] * 3), GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.chat(_chat("?", test_image()), GREEDY)[0].outputs[0].token_ids  # and the engine still answers


def test_a_text_only_model_refuses_images(tiny_model) -> None:
    llm = LLM(str(tiny_model("llama")), kv_cache_memory="16MiB", max_model_len=256)
    assert llm.engine.modalities == ("text",)
    with pytest.raises(PromptError, match="does not accept images"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": png_bytes(test_image())}}, GREEDY)

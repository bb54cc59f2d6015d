"""Fast mode's quality on an image prompt is a measured bound, as for text: a SmolVLM text GGUF in Q8_0 plus
its Q8_0 mmproj (the GGUF blocks as stored, 8-bit activations: what the native runner serves) against the
safetensors directory in exact mode, KL divergence of the next-token distributions at every position.

The bound is relative to the same files' KL on a text prompt (measured in the same test): an image may cost
its quantized tower's share, not more. Measured 2026-11-25 (Intel Xeon, AVX-512): 0.0199 with the image,
0.0134 on text (the tiny random-weight model's large activations make both larger than a real model's)."""
from __future__ import annotations

import torch

from runlm.models.evaluate import all_logits, mean_kl
from runlm.models.load import LoadedModel, load_decoder
from tests.fixtures.vlm import test_image, vlm_dir
from tests.fixtures.vlm.gguf import vlm_gguf

IMAGE_OVER_TEXT = 2.0  # the image prompt's KL at most twice the text prompt's (measured: 1.49x)


def _logits(loaded: LoadedModel, messages: list[dict], image) -> torch.Tensor:
    from runlm.engine.llm import encode_chat

    assert loaded.vision is not None
    prompt = loaded.vision.processor.process(encode_chat(loaded.tokenizer, messages), [image])
    (embeds,) = loaded.vision.encode(prompt.features)
    rows = torch.from_numpy(prompt.features[0].positions)
    return all_logits(loaded.model, prompt.token_ids, chunk=4096, mm_embeds=(rows, embeds))


def test_fast_mode_kl_on_an_image_prompt_is_bounded() -> None:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the picture."}]}]
    image = test_image(96, 64, seed=5)
    exact_model = load_decoder(vlm_dir("idefics3"), exact_numerics=True)
    exact = _logits(exact_model, messages, image)
    text, mmproj = vlm_gguf("idefics3", "q8_0")
    fast_model = load_decoder(text, mmproj=mmproj)
    fast = _logits(fast_model, messages, image)
    assert fast.shape == exact.shape
    kl = mean_kl(exact, fast)
    ids = fast_model.tokenizer.encode("Describe the picture. The quick brown fox jumps over the lazy dog, and then "
                                      "it runs home again to sleep.")
    text_kl = mean_kl(all_logits(exact_model.model, ids), all_logits(fast_model.model, ids))
    assert 0 < kl <= IMAGE_OVER_TEXT * text_kl, \
        f"fast mode's KL divergence: {kl:.6f} on the image prompt, {text_kl:.6f} on text"

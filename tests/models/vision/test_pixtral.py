"""Mistral 3 (runlm.models.vision.pixtral) against transformers' PixtralImageProcessor and
Mistral3ForConditionalGeneration on a tiny random-weight model (tests/fixtures/vlm/pixtral.py).

transformers' PixtralProcessor needs torchvision (not installed), so the prompt's expansion is checked against
its replace_image_token written out below (text expanded, then tokenized), and the model's own placeholder check
(one [IMG] per merged patch, in order) and the logits check the rest. Parity: pixel values within 1e-6, the
tower + projector within 1e-4 of ``get_image_features``, prompt logits within 1e-4 relative, 20 greedy tokens
through ``runlm.LLM.chat`` identical to transformers'.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from runlm.formats.tokenizer import Tokenizer
from runlm.models import vision as vlm
from runlm.models.attention import ForwardContext, forward_context
from runlm.models.load import load_decoder
from runlm.models.vision import pixtral, processor_config
from runlm.models.vision.images import ImageError
from tests.fixtures.vlm import png_bytes, vlm_dir
from tests.fixtures.vlm import test_image as picture
from tests.fixtures.vlm.pixtral import MERGE, PATCH_SIZE, expand_prompt

PROMPT = "[INST][IMG]What is in this picture?[/INST]"
GREEDY_TOKENS = 20
RTOL = 1e-4
# (width, height): wide, tall, square, tiny, larger than the longest edge both ways, a thin strip
SIZES = [(96, 64), (20, 50), (32, 32), (7, 9), (150, 120), (200, 30)]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return vlm_dir("pixtral")



@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import Mistral3ForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    settings = {k: v for k, v in processor_config(model_dir).items() if k != "image_processor_type"}
    # PixtralProcessor hands its image processor patch_size x spatial_merge_size
    image_processor = PixtralImageProcessorPil(**{**settings, "patch_size": {"height": PATCH_SIZE * MERGE,
                                                                              "width": PATCH_SIZE * MERGE}})
    model = Mistral3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return image_processor, model


@pytest.fixture(scope="module")
def ours(model_dir):
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    tok = Tokenizer.from_dir(model_dir)
    vision = [(k, v) for k, v in weights.items() if pixtral.text_weight(k) is None]
    return pixtral.build(cfg, processor_config(model_dir), vision, tok), tok


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.hf.encode(text, add_special_tokens=False).ids


def test_family_is_found(model_dir) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert vlm.hf_family(cfg) is pixtral and vlm.mmproj_family("pixtral") is pixtral
    text = pixtral.text_config(cfg)
    assert text["architectures"] == ["MistralForCausalLM"] and text["head_dim"] == 16


def test_processor_parity(hf, ours) -> None:
    image_processor, _ = hf
    vision, tok = ours
    for i, (w, h) in enumerate(SIZES):
        image = picture(w, h, seed=i)
        ref = image_processor(images=image, return_tensors="np")
        mm = vision.processor.process(_ids(tok, PROMPT), [image])
        pixels = mm.features[0].data["pixel_values"]
        assert pixels.shape == ref["pixel_values"].shape[1:], f"{w}x{h}"
        assert np.abs(pixels - ref["pixel_values"][0]).max() <= 1e-6, f"{w}x{h}"
        assert mm.token_ids == _ids(tok, expand_prompt(PROMPT, ref["image_sizes"])), f"{w}x{h}"
        f = mm.features[0]
        assert [mm.token_ids[p] for p in f.positions] == [vision.processor.image_token_id] * f.num_embeds
        assert mm.token_ids[f.end] == vision.processor.end_token_id


def test_two_images(hf, ours) -> None:
    image_processor, _ = hf
    vision, tok = ours
    text = "[INST][IMG]and[IMG]compare[/INST]"
    images = [picture(96, 64, seed=1), picture(20, 50, seed=2)]
    mm = vision.processor.process(_ids(tok, text), images)
    sizes = [image_processor(images=im, return_tensors="np")["image_sizes"][0] for im in images]
    assert mm.token_ids == _ids(tok, expand_prompt(text, sizes))
    assert mm.features[0].end < mm.features[1].start
    with pytest.raises(ImageError, match="2 \\[IMG\\] placeholders for 1 images"):
        vision.processor.process(_ids(tok, text), images[:1])


def test_tower_parity(hf, ours) -> None:
    """encode() over images of several sizes (two of one size, batched) vs get_image_features."""
    image_processor, model = hf
    vision, tok = ours
    images = [picture(w, h, seed=i) for i, (w, h) in enumerate([(96, 64), (20, 50), (90, 60), (200, 30)])]
    mm = vision.processor.process(_ids(tok, PROMPT * len(images)), images)
    embeds = vision.encode(mm.features)
    for image, ours_, f in zip(images, embeds, mm.features):
        ref = image_processor(images=image, return_tensors="pt")
        with torch.no_grad():
            theirs = model.get_image_features(pixel_values=ref["pixel_values"],
                                              image_sizes=ref["image_sizes"]).pooler_output[0]
        assert ours_.shape == (f.num_embeds, model.config.text_config.hidden_size) == theirs.shape
        assert (ours_ - theirs).abs().max().item() <= 1e-4


def _hf_greedy(model, inputs: dict) -> list[int]:
    tokens: list[int] = []
    with torch.no_grad():
        step = model(**inputs, use_cache=True)
        for _ in range(GREEDY_TOKENS):
            token = int(step.logits[0, -1].argmax())
            tokens.append(token)
            step = model(input_ids=torch.tensor([[token]]), cache=step.cache, use_cache=True)
    return tokens


def test_end_to_end(model_dir, hf) -> None:
    image_processor, model = hf
    image = picture(96, 64, seed=3)
    question = "What is in this picture?"
    loaded = load_decoder(model_dir, exact_numerics=True)
    assert loaded.vision is not None
    tok = loaded.tokenizer
    text = "<|im_start|>" + PROMPT  # the template's bos_token, then the user turn
    ref = image_processor(images=image, return_tensors="pt")
    ids = _ids(tok, expand_prompt(text, ref["image_sizes"]))
    inputs = {"input_ids": torch.tensor([ids]), "pixel_values": ref["pixel_values"], "image_sizes": ref["image_sizes"]}
    with torch.no_grad():
        ref_logits = model(**inputs).logits[0]

    mm = loaded.vision.processor.process(_ids(tok, text), [image])
    assert mm.token_ids == ids
    ctx = ForwardContext.no_cache([len(ids)])
    f = mm.features[0]
    ctx.mm_embeds = (torch.from_numpy(f.positions), loaded.vision.encode([f])[0])
    with torch.inference_mode(), forward_context(ctx):
        logits = loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids))))
    rel = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert rel < RTOL, f"logits differ by {rel:.2e} relative"

    llm = LLM(str(model_dir), exact_numerics=True, block_size=4, kv_cache_memory="64MiB", max_model_len=512)
    messages = [{"role": "user", "content": [{"type": "image", "image": png_bytes(image)},
                                             {"type": "text", "text": question}]}]
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    out = llm.chat(messages, params)[0]
    assert out.prompt_token_ids == ids
    expected = _hf_greedy(model, inputs)
    assert out.outputs[0].token_ids == expected
    # 5-token prefill chunks: cuts between an image's rows and inside them, the [IMG_BREAK]s in between
    chunked = LLM(str(model_dir), exact_numerics=True, block_size=4, kv_cache_memory="64MiB", max_model_len=512,
                  max_num_batched_tokens=5)
    assert chunked.chat(messages, params)[0].outputs[0].token_ids == expected
    other = [{"role": "user", "content": [{"type": "image", "image": picture(40, 70, seed=8)},
                                          {"type": "text", "text": question}]}]
    assert llm.chat(other, params)[0].outputs[0].token_ids != expected


def test_extreme_aspect_ratio_refused(ours) -> None:
    vision, tok = ours
    with pytest.raises(ImageError, match="aspect ratio is too extreme"):
        vision.processor.process(_ids(tok, PROMPT), [Image.new("RGB", (2000, 1))])
    # a strip that keeps one row of patches is fine
    mm = vision.processor.process(_ids(tok, PROMPT), [Image.new("RGB", (2000, 40))])
    assert mm.features[0].data["pixel_values"].shape == (3, 16, 64)


def test_mistral_small_3_1_hub_files() -> None:
    """mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json and processor settings: the decoder's config
    and the [IMG] grid of a 1024 x 768 picture (28-pixel cells: 37 x 28)."""
    from runlm.models.config import ModelConfig

    cfg = {"architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
           "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
           "text_config": {"attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
                           "initializer_range": 0.02, "intermediate_size": 32768, "max_position_embeddings": 131072,
                           "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40,
                           "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
                           "sliding_window": None, "use_cache": True, "vocab_size": 131072},
           "torch_dtype": "bfloat16",
           "vision_config": {"attention_dropout": 0.0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024,
                             "image_size": 1540, "initializer_range": 0.02, "intermediate_size": 4096,
                             "model_type": "pixtral", "num_attention_heads": 16, "num_channels": 3,
                             "num_hidden_layers": 24, "patch_size": 14, "rope_theta": 10000.0},
           "vision_feature_layer": -1}
    pre = {"do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
           "image_processor_type": "PixtralImageProcessor", "image_std": [0.26862954, 0.26130258, 0.27577711],
           "patch_size": {"height": 14, "width": 14}, "resample": 3, "rescale_factor": 0.00392156862745098,
           "size": {"longest_edge": 1540}}
    mc = ModelConfig.from_hf(pixtral.text_config(cfg))
    assert (mc.family, mc.hidden_size, mc.head_dim, mc.num_layers, mc.num_kv_heads, mc.rope_theta, mc.sliding_window,
            mc.tie_word_embeddings) == ("mistral", 5120, 128, 40, 8, 1e9, None, False)
    assert pixtral.vision_config(cfg)["hidden_act"] == "silu"
    processor = pixtral.PixtralImageProcessor(pre, 14 * 2, (10, 12, 13))
    mm = processor.process([1, 3, 10, 4], [picture(1024, 768)])
    f = mm.features[0]
    assert f.data["pixel_values"].shape == (3, 784, 1036) and f.num_embeds == 28 * 37
    assert len(mm.token_ids) == 3 + 28 * 38 and mm.token_ids.count(12) == 27 and mm.token_ids[-2] == 13

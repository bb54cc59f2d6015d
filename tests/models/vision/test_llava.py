"""LLaVA (runlm.models.vision.llava) against transformers' LlavaProcessor and LlavaForConditionalGeneration on
the same tiny random-weight models (tests/fixtures/vlm/llava.py): LLaVA-1.5's shape (CLIP tower, feature layer
-2, class token dropped, CLIPImageProcessor), a SigLIP tower read in full at its last layer, and Pixtral-12B's
shape (a Pixtral tower, each image at its own size, PixtralProcessor's [IMG] grid; runlm.models.vision.pixtral).

Parity: pixel values within 1e-6 (they come out equal), the expanded prompt ids identical, the tower + projector
within 1e-4 of ``get_image_features``, the prompt's logits within 1e-4 relative, and 20 greedy tokens through
``runlm.LLM.chat`` identical to transformers' argmax decoding.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runlm.engine.llm import LLM
from runlm.engine.types.errors import PromptError
from runlm.engine.types.sampling_params import SamplingParams
from runlm.formats.tokenizer import Tokenizer
from runlm.models.attention import ForwardContext, forward_context
from runlm.models.load import load_decoder
from runlm.models.vision import hf_family, llava, processor_config
from runlm.models.vision.images import ImageError, open_image
from tests.fixtures.vlm import png_bytes, vlm_dir
from tests.fixtures.vlm import test_image as picture
from tests.fixtures.vlm.llava import pixtral_dir, siglip_dir
from tests.fixtures.vlm.pixtral import expand_prompt

PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"
GREEDY_TOKENS = 20
RTOL = 1e-4
# (width, height): wide, tall, square at the crop size, smaller than the crop, odd sizes
SIZES = [(96, 64), (20, 50), (32, 32), (7, 9), (33, 120)]


@pytest.fixture(scope="module", params=["clip", "siglip"])
def model_dir(request) -> Path:
    return vlm_dir("llava") if request.param == "clip" else siglip_dir()


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(model_dir))
    model = LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return processor, model


@pytest.fixture(scope="module")
def ours(model_dir):
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    vision = [(k, v) for k, v in weights.items() if llava.text_weight(k) is None]
    tok = Tokenizer.from_dir(model_dir)
    return llava.build(cfg, processor_config(model_dir), vision, tok), tok


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.hf.encode(text, add_special_tokens=False).ids


def test_family_is_found(model_dir) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert hf_family(cfg) is llava
    assert llava.text_config(cfg)["architectures"] == ["LlamaForCausalLM"]


def test_processor_parity(hf, ours) -> None:
    processor, _ = hf
    vision, tok = ours
    for i, (w, h) in enumerate(SIZES):
        image = picture(w, h, seed=i)
        ref = processor(images=image, text=PROMPT, return_tensors="pt")
        mm = vision.processor.process(_ids(tok, PROMPT), [image])
        pixels = mm.features[0].data["pixel_values"]
        assert pixels.dtype == np.float32 and pixels.shape == tuple(ref["pixel_values"].shape[1:])
        diff = np.abs(pixels - ref["pixel_values"][0].numpy()).max()
        assert diff <= 1e-6, f"{w}x{h}: pixel values differ by {diff}"
        assert mm.token_ids == ref["input_ids"][0].tolist()
        f = mm.features[0]
        assert f.num_embeds == mm.token_ids.count(vision.processor.image_token_id) and not f.bidirectional
        assert mm.token_ids[f.start:f.end] == [vision.processor.image_token_id] * f.num_embeds


def test_processor_two_images_and_modes(hf, ours) -> None:
    """Two images in one prompt, in order; an RGBA and a grayscale picture as transformers converts them."""
    processor, _ = hf
    vision, tok = ours
    text = "USER: <image>\nand <image>\ncompare them ASSISTANT:"
    rgba = picture(40, 30, seed=5).convert("RGBA")
    gray = picture(30, 44, seed=6).convert("L")
    ref = processor(images=[rgba, gray], text=text, return_tensors="pt")
    mm = vision.processor.process(_ids(tok, text), [open_image(png_bytes(rgba)), open_image(png_bytes(gray))])
    assert mm.token_ids == ref["input_ids"][0].tolist()
    assert len(mm.features) == 2 and mm.features[0].end < mm.features[1].start
    for f, px in zip(mm.features, ref["pixel_values"]):
        assert np.abs(f.data["pixel_values"] - px.numpy()).max() <= 1e-6
    # the hash: the same picture twice is one image; another picture is another
    again = vision.processor.process(_ids(tok, text), [open_image(png_bytes(rgba)), open_image(png_bytes(rgba))])
    assert again.features[0].hash == again.features[1].hash == mm.features[0].hash != mm.features[1].hash


def test_placeholders_must_match_images(ours) -> None:
    vision, tok = ours
    with pytest.raises(ImageError, match="1 <image> placeholders for 2 images"):
        vision.processor.process(_ids(tok, PROMPT), [picture(), picture()])
    with pytest.raises(ImageError, match="0 <image> placeholders for 1 images"):
        vision.processor.process(_ids(tok, "USER: hi ASSISTANT:"), [picture()])


def test_tower_parity(hf, ours) -> None:
    """encode() over a batch of images vs get_image_features, image by image."""
    processor, model = hf
    vision, tok = ours
    images = [picture(w, h, seed=i) for i, (w, h) in enumerate(SIZES[:3])]
    mm = vision.processor.process(_ids(tok, PROMPT * len(images)), images)
    embeds = vision.encode(mm.features)
    pixels = processor(images=images, text=PROMPT * len(images), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = model.get_image_features(pixel_values=pixels).pooler_output
    for ours_, theirs, f in zip(embeds, ref, mm.features):
        assert ours_.dtype == torch.float32 and ours_.shape == (f.num_embeds, model.config.text_config.hidden_size)
        assert (ours_ - theirs).abs().max().item() <= 1e-4
    assert (embeds[0] - embeds[1]).abs().max() > 0.1  # the picture matters


def test_text_weight_names() -> None:
    assert llava.text_weight("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert llava.text_weight("language_model.model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert llava.text_weight("lm_head.weight") == llava.text_weight("language_model.lm_head.weight") == \
        "lm_head.weight"
    for name in ("model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "vision_tower.head.probe",
                 "multi_modal_projector.linear_1.weight", "model.multi_modal_projector.linear_2.bias"):
        assert llava.text_weight(name) is None


def test_configs_without_defaults() -> None:
    """llava-hf's config.json names only what differs from transformers' defaults."""
    cfg = {"model_type": "llava", "text_config": {"model_type": "llama", "vocab_size": 32064},
           "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336,
                             "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
                             "patch_size": 14}}
    text = llava.text_config(cfg)
    assert (text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"], text["vocab_size"]) == \
        (4096, 11008, 32, 32064)
    vision = llava.vision_config(cfg)
    assert (vision["hidden_act"], vision["layer_norm_eps"]) == ("quick_gelu", 1e-5)
    with pytest.raises(ValueError, match="intern_vit_6b"):
        llava.vision_config({"vision_config": {"model_type": "intern_vit_6b"}})


def _chat_template(llm: LLM) -> str:
    # runlm's renderer does not know transformers' {% generation %} tag (it marks assistant text for training)
    template = llm.engine.tokenizer.chat_template
    assert template is not None
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def _hf_greedy(model, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> list[int]:
    tokens: list[int] = []
    with torch.no_grad():
        step = model(input_ids=input_ids, pixel_values=pixel_values, use_cache=True)
        for _ in range(GREEDY_TOKENS):
            token = int(step.logits[0, -1].argmax())
            tokens.append(token)
            step = model(input_ids=torch.tensor([[token]]), cache=step.cache, use_cache=True)
    return tokens


def test_end_to_end(model_dir, hf) -> None:
    processor, model = hf
    image = picture(96, 64, seed=3)
    question = "What is in this picture?"
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    inputs = processor(images=image, text=text, return_tensors="pt")
    with torch.no_grad():
        ref_logits = model(**inputs).logits[0]

    # the prompt's logits, every position (the image's rows spliced over its placeholders)
    loaded = load_decoder(model_dir, exact_numerics=True)
    assert loaded.vision is not None
    mm = loaded.vision.processor.process(_ids(loaded.tokenizer, text), [image])
    ids = inputs["input_ids"][0].tolist()
    assert mm.token_ids == ids
    ctx = ForwardContext.no_cache([len(ids)])
    f = mm.features[0]
    ctx.mm_embeds = (torch.from_numpy(f.positions), loaded.vision.encode([f])[0])
    with torch.inference_mode(), forward_context(ctx):
        logits = loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids))))
    rel = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert rel < RTOL, f"logits differ by {rel:.2e} relative"

    # greedy decoding through the engine, the image sent as PNG bytes in a chat message
    llm = LLM(str(model_dir), exact_numerics=True, block_size=4, kv_cache_memory="64MiB", max_model_len=512)
    assert llm.engine.modalities == ("text", "image")
    messages = [{"role": "user", "content": [{"type": "image", "image": png_bytes(image)},
                                             {"type": "text", "text": question}]}]
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=1)
    out = llm.chat(messages, params, chat_template=_chat_template(llm))[0]
    assert out.prompt_token_ids == ids
    expected = _hf_greedy(model, inputs["input_ids"], inputs["pixel_values"])
    assert out.outputs[0].token_ids == expected
    # the first token's logprob vs transformers' last prompt position
    first = out.outputs[0].logprobs[0][expected[0]].logprob
    assert abs(first - torch.log_softmax(ref_logits[-1], -1)[expected[0]].item()) < 1e-4

    # the same picture again: no tower work (the encoder cache); another picture: other tokens
    encoded = llm.engine.encoder_cache.images_encoded
    again = llm.chat(messages, params, chat_template=_chat_template(llm))[0]
    assert again.outputs[0].token_ids == expected and llm.engine.encoder_cache.images_encoded == encoded
    other = [{"role": "user", "content": [{"type": "image", "image": picture(50, 80, seed=9)},
                                          {"type": "text", "text": question}]}]
    assert llm.chat(other, params, chat_template=_chat_template(llm))[0].outputs[0].token_ids != expected

    # vLLM's prompt form: the rendered text with its <image>, the picture beside it
    prompt = {"prompt": text, "multi_modal_data": {"image": image}}
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == expected
    with pytest.raises(PromptError, match="placeholders for 2 images"):
        llm.generate([{"prompt": text, "multi_modal_data": {"image": [image, image]}}], params)


def test_chat_with_the_shipped_template(model_dir) -> None:
    llm = LLM(str(model_dir), exact_numerics=True, kv_cache_memory="64MiB", max_model_len=512)
    messages = [{"role": "user", "content": [{"type": "image", "image": picture()},
                                             {"type": "text", "text": "hi"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert len(out.outputs[0].token_ids) == 2


def test_transparent_image(hf, ours) -> None:
    """open_image lays a transparent picture over white, as transformers' convert_to_rgb does."""
    processor, _ = hf
    vision, tok = ours
    rgba = picture(40, 30, seed=7).convert("RGBA")
    alpha = np.zeros((30, 40), dtype=np.uint8)
    alpha[:, 20:] = 255
    rgba.putalpha(Image.fromarray(alpha, "L"))
    ref = processor(images=rgba, text=PROMPT, return_tensors="pt")["pixel_values"][0].numpy()
    mm = vision.processor.process(_ids(tok, PROMPT), [open_image(png_bytes(rgba))])
    assert np.abs(mm.features[0].data["pixel_values"] - ref).max() <= 1e-6


def test_llava_image_processor_pads_to_square() -> None:
    """LlavaImageProcessor with do_pad: the image padded to a square in the mean colour before the resize."""
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    ref = LlavaImageProcessorPil(do_pad=True, size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32})
    config = ref.to_dict()
    assert config["image_processor_type"] == "LlavaImageProcessor"
    ours = llava.LlavaImageProcessor(config, image_token_id=7, num_image_tokens=16, image_size=32, siglip=False)
    for i, (w, h) in enumerate(SIZES):
        image = picture(w, h, seed=i)
        expected = ref(images=image, return_tensors="np")["pixel_values"][0]
        assert np.abs(ours.pixels(image) - expected).max() <= 1e-6, f"{w}x{h}"
    with pytest.raises(ValueError, match="not the tower's 48x48"):
        llava.LlavaImageProcessor(config, image_token_id=7, num_image_tokens=36, image_size=48, siglip=False)


# ---- Pixtral-12B's shape: model_type llava with a Pixtral tower ------------------------------------------------
PIXTRAL_PROMPT = "[INST][IMG]What is in this picture?[/INST]"


@pytest.fixture(scope="module")
def pixtral_model():
    from transformers import LlavaForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    path = pixtral_dir()
    settings = {k: v for k, v in processor_config(path).items() if k != "image_processor_type"}
    model = LlavaForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, PixtralImageProcessorPil(**settings), model


def test_pixtral_tower(pixtral_model) -> None:
    path, image_processor, model = pixtral_model
    loaded = load_decoder(path, exact_numerics=True)
    vision, tok = loaded.vision, loaded.tokenizer
    assert vision is not None and hf_family(json.loads((path / "config.json").read_text())) is llava
    step = model.config.vision_config.patch_size
    images = [picture(w, h, seed=i) for i, (w, h) in enumerate([(96, 64), (20, 50), (150, 120)])]
    mm = vision.processor.process(_ids(tok, PIXTRAL_PROMPT * 3), images)
    embeds = vision.encode(mm.features)
    ref = image_processor(images=images, return_tensors="pt")  # padded to one size, with the true sizes
    assert mm.token_ids == _ids(tok, expand_prompt(PIXTRAL_PROMPT * 3, ref["image_sizes"], step))
    with torch.no_grad():
        theirs = model.get_image_features(pixel_values=ref["pixel_values"], image_sizes=ref["image_sizes"],
                                          vision_feature_layer=-1, vision_feature_select_strategy="full").pooler_output
    for i, (f, ours_, theirs_) in enumerate(zip(mm.features, embeds, theirs)):
        h, w = ref["image_sizes"][i].tolist()
        # each image at its own size (transformers pads the batch to the largest, zeros right and below)
        assert np.abs(f.data["pixel_values"] - ref["pixel_values"][i, :, :h, :w].numpy()).max() <= 1e-6
        assert ours_.shape == theirs_.shape and (ours_ - theirs_).abs().max().item() <= 1e-4


def test_pixtral_end_to_end(pixtral_model) -> None:
    path, image_processor, model = pixtral_model
    image = picture(96, 64, seed=3)
    step = model.config.vision_config.patch_size
    llm = LLM(str(path), exact_numerics=True, block_size=4, kv_cache_memory="64MiB", max_model_len=512)
    tok = llm.engine.tokenizer
    ref = image_processor(images=image, return_tensors="pt")
    ids = _ids(tok, expand_prompt("<|im_start|>" + PIXTRAL_PROMPT, ref["image_sizes"], step))
    messages = [{"role": "user", "content": [{"type": "image", "image": png_bytes(image)},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=1)
    out = llm.chat(messages, params)[0]
    assert out.prompt_token_ids == ids
    inputs = {"input_ids": torch.tensor([ids]), "pixel_values": ref["pixel_values"], "image_sizes": ref["image_sizes"]}
    with torch.no_grad():
        last = model(**inputs).logits[0, -1]
    expected = []
    with torch.no_grad():
        step_out = model(**inputs, use_cache=True)
        for _ in range(GREEDY_TOKENS):
            token = int(step_out.logits[0, -1].argmax())
            expected.append(token)
            step_out = model(input_ids=torch.tensor([[token]]), cache=step_out.cache, use_cache=True)
    assert out.outputs[0].token_ids == expected
    first = out.outputs[0].logprobs[0][expected[0]].logprob
    assert abs(first - torch.log_softmax(last, -1)[expected[0]].item()) < 1e-4


def test_multi_turn_prompt_as_transformers_renders_it(hf, model_dir) -> None:
    processor, _ = hf
    llm = LLM(str(model_dir), exact_numerics=True, kv_cache_memory="64MiB", max_model_len=512)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
                {"role": "user", "content": [{"type": "text", "text": "What colour?"}]}]
    expected = processor.tokenizer.encode(processor.apply_chat_template(messages, add_generation_prompt=True),
                                          add_special_tokens=False)
    assert llm.encode_chat(messages, _chat_template(llm)) == expected


def test_chunks_batches_and_prefix_cache(model_dir, hf) -> None:
    """7-token prefill chunks (an image's 16 rows cut across three steps), two requests with
    different images in one batch, then the first again from the prefix cache: each as decoded alone."""
    processor, model = hf
    images = [picture(96, 64, seed=3), picture(50, 80, seed=4)]
    messages = [[{"role": "user", "content": [{"type": "image", "image": png_bytes(im)},
                                              {"type": "text", "text": "What is in this picture?"}]}]
                for im in images]
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    expected = [_hf_greedy(model, inputs["input_ids"], inputs["pixel_values"])
                for inputs in (processor(images=im, text=text, return_tensors="pt") for im in images)]
    llm = LLM(str(model_dir), exact_numerics=True, block_size=4, kv_cache_memory="64MiB", max_model_len=512,
              max_num_batched_tokens=7)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = llm.chat(messages, params, chat_template=_chat_template(llm))
    assert [o.outputs[0].token_ids for o in outs] == expected
    llm.reset_mm_cache()  # the prefix cache alone serves the image's blocks
    again = llm.chat(messages[0], params, chat_template=_chat_template(llm))[0]
    assert again.outputs[0].token_ids == expected[0] and again.num_cached_tokens >= 16


def test_extreme_aspect_ratio_refused(ours) -> None:
    """A thin strip whose shortest edge, scaled up, would make a resized image of billions of pixels."""
    vision, tok = ours
    strip = Image.new("RGB", (40000, 1))
    if vision.processor.siglip:  # resized straight to the square
        assert vision.processor.process(_ids(tok, PROMPT), [strip]).features[0].data["pixel_values"].shape == \
            (3, 32, 32)
    else:
        with pytest.raises(ImageError, match="aspect ratio is too extreme"):
            vision.processor.process(_ids(tok, PROMPT), [strip])
    pad = llava.LlavaImageProcessor({"image_processor_type": "LlavaImageProcessor", "do_pad": True,
                                     "size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}},
                                    image_token_id=7, num_image_tokens=16, image_size=32, siglip=False)
    with pytest.raises(ImageError, match="padded to a square"):
        pad.pixels(Image.new("RGB", (20000, 2)))


def test_the_family_modules_import_no_torch() -> None:
    """Every family module is imported to ask whether it serves a config: llava's and pixtral's bring no torch
    (their towers are runlm.models.vision.llava_tower and pixtral_tower, imported by build)."""
    import subprocess
    import sys

    code = ("import sys, runlm.models.vision.llava as l, runlm.models.vision.pixtral as p; "
            "l.text_config({'text_config': {'model_type': 'mistral'}}); l.vision_config({}); l.text_weight('x'); "
            "p.text_config({}); p.vision_config({}); p.text_weight('lm_head.weight'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]


def test_llava_1_5_hub_files() -> None:
    """llava-hf/llava-1.5-7b-hf's config.json and preprocessor_config.json as the hub has them: the decoder's
    config, the tower's, and 576 soft tokens per 336 x 336 crop."""
    from runlm.models.config import ModelConfig

    cfg = {"architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
           "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
           "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                           "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                           "torch_dtype": "float16", "vocab_size": 32064},
           "tie_word_embeddings": False, "torch_dtype": "float16",
           "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                             "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                             "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
           "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}
    pre = {"crop_size": {"height": 336, "width": 336}, "do_center_crop": True, "do_convert_rgb": True,
           "do_normalize": True, "do_rescale": True, "do_resize": True,
           "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "CLIPImageProcessor",
           "image_std": [0.26862954, 0.26130258, 0.27577711], "processor_class": "LlavaProcessor", "resample": 3,
           "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 336}}
    mc = ModelConfig.from_hf(llava.text_config(cfg))
    assert (mc.family, mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.vocab_size,
            mc.max_position_embeddings, mc.rms_norm_eps, mc.tie_word_embeddings) == \
        ("llama", 4096, 32, 32, 32, 32064, 4096, 1e-5, False)
    processor = llava.LlavaImageProcessor(pre, 32000, 24 * 24, 336, siglip=False)
    mm = processor.process([1, 3148, 29901, 29871, 32000, 29871, 13, 5618], [picture(640, 480)])
    assert mm.features[0].num_embeds == 576 and len(mm.token_ids) == 7 + 576
    assert mm.features[0].data["pixel_values"].shape == (3, 336, 336)

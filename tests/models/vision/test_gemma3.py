"""Gemma 3's vision family against transformers: the processor (pixels and the expanded token ids of
Gemma3Processor), the tower + projector (get_image_features), and whole conversations with images through
runlm.LLM (logits and greedy tokens of Gemma3ForConditionalGeneration). The tiny model: tests/fixtures/vlm/gemma3.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from runlm.formats import ModelFormatError
from runlm.models.config import ModelConfig
from runlm.models.vision import gemma3
from runlm.models.vision.images import ImageError, open_image
from tests.fixtures.vlm import png_bytes, vlm_dir
from tests.fixtures.vlm import test_image as picture

TEXT = "Describe this image."


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return vlm_dir("gemma3")


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return AutoProcessor.from_pretrained(str(model_dir)), model


@pytest.fixture(scope="module")
def loaded(model_dir: Path):
    from runlm.models.load import load_decoder

    return load_decoder(model_dir, exact_numerics=True)


def images() -> list:
    # wider, taller, smaller and larger than the tower's 64 x 64, and one square already at its size
    return [picture(96, 64, 0), picture(40, 90, 1), picture(17, 23, 2), picture(300, 200, 3),
            picture(64, 64, 4)]


CONVERSATIONS = {
    "one image": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}],
    "text first": [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                                {"type": "text", "text": "What is it?"}]}],
    "two images, text between": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "text", "text": TEXT}]}],
    "two images side by side": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
    "system and turns": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": [{"type": "text", "text": "See\n"}, {"type": "image"}]}],
}


def _count_images(messages: list[dict]) -> int:
    return sum(isinstance(m["content"], list) and sum(p["type"] == "image" for p in m["content"]) for m in messages)


def test_text_weights_in_both_checkpoint_layouts() -> None:
    assert gemma3.text_weight("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert gemma3.text_weight("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert gemma3.text_weight("lm_head.weight") == "lm_head.weight"
    assert gemma3.text_weight("language_model.model.norm.weight") == "model.norm.weight"
    assert gemma3.text_weight("language_model.lm_head.weight") == "lm_head.weight"
    for name in ("model.vision_tower.vision_model.post_layernorm.weight", "vision_tower.vision_model.head.probe",
                 "vision_tower.encoder.layers.0.mlp.fc1.weight", "model.multi_modal_projector.mm_input_projection_weight",
                 "multi_modal_projector.mm_soft_emb_norm.weight"):
        assert gemma3.text_weight(name) is None


def test_text_config_of_a_hub_config_takes_gemma3_text_defaults() -> None:
    """google/gemma-3-4b-it's config.json names few text settings: the rest are Gemma3TextConfig's defaults."""
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
           "mm_tokens_per_image": 256, "text_config": {
               "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
               "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}
    cfg = ModelConfig.from_hf(gemma3.text_config(hub))
    assert (cfg.family, cfg.hidden_size, cfg.num_layers, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == \
        ("gemma3", 2560, 34, 256, 8, 4)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.sliding_window, cfg.query_pre_attn_scalar) == \
        (1_000_000.0, 10_000.0, 1024, 256)
    assert cfg.rope_scaling == {"factor": 8.0, "rope_type": "linear"} and cfg.tie_word_embeddings
    assert cfg.eos_token_ids == [1, 106] and cfg.vocab_size == 262_208 and cfg.rms_norm_eps == 1e-6
    assert cfg.layer_types is not None and cfg.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]


def test_the_family_module_imports_no_torch() -> None:
    """Every family module is imported to ask whether it serves a config: this one brings no torch with it
    (the tower's classes are made by build)."""
    import subprocess
    import sys

    code = ("import sys, runlm.models.vision.gemma3 as g; g.text_config({}); g.text_weight('lm_head.weight'); "
            "assert 'torch' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def _layout(name: str, layout: str) -> str:
    """A transformers 5 saved name (language_model.model.X, vision_tower.X, multi_modal_projector.X) in another
    checkpoint layout: the hub's (vision_tower.vision_model.X) or transformers 4.5x's (model.language_model.X)."""
    if name.startswith("vision_tower."):
        name = "vision_tower.vision_model." + name[len("vision_tower."):]
    if layout == "transformers-4":
        if name.startswith("language_model.model."):
            return "model.language_model." + name[len("language_model.model."):]
        return "lm_head.weight" if name == "language_model.lm_head.weight" else "model." + name
    return name


@pytest.mark.parametrize("layout", ["hub", "transformers-4"])
def test_loads_every_checkpoint_layout(layout: str, model_dir: Path, loaded, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from runlm.models.load import load_decoder

    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(model_dir / "model.safetensors")
    save_file({_layout(k, layout): v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    if layout == "hub":  # the hub's processor files: the image processor's settings in preprocessor_config.json
        import json

        both = json.loads((model_dir / "processor_config.json").read_text())
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(
            {**both.pop("image_processor"), "processor_class": "Gemma3Processor"}))
        (tmp_path / "processor_config.json").write_text(json.dumps(both))
    from transformers import Gemma3ForConditionalGeneration

    _, info = Gemma3ForConditionalGeneration.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(info.values()), info  # a layout transformers reads as it is
    other = load_decoder(tmp_path, exact_numerics=True)
    assert other.vision is not None
    for a, b in zip(loaded.model.state_dict().values(), other.model.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(loaded.vision.state_dict().values(), other.vision.state_dict().values()):
        assert torch.equal(a, b)
    assert other.vision.processor.settings == loaded.vision.processor.settings


def test_builds_from_the_vision_part_alone(model_dir: Path, loaded) -> None:
    """As from an mmproj file: no text config and no token ids in the config (the tokenizer's are used), the
    text model's width read from the projection."""
    from safetensors.torch import load_file

    from runlm.models.weights import read_hf_config

    cfg = read_hf_config(model_dir)
    bare = {"model_type": "gemma3", "vision_config": cfg["vision_config"], "mm_tokens_per_image": 16}
    weights = [(k, v) for k, v in load_file(model_dir / "model.safetensors").items() if gemma3.text_weight(k) is None]
    preprocessor = {"size": {"height": 64, "width": 64}}
    vision = gemma3.build(bare, preprocessor, weights, loaded.tokenizer)
    ids = loaded.tokenizer.encode("<|im_start|>Look<start_of_image>", add_special_tokens=False)
    ours, theirs = (v.processor.process(ids, [picture()]) for v in (vision, loaded.vision))
    assert ours.token_ids == theirs.token_ids
    assert torch.equal(vision.encode(ours.features)[0], loaded.vision.encode(theirs.features)[0])


def test_loads_as_gemma3_text_with_its_vision(loaded) -> None:
    assert loaded.config.family == "gemma3" and loaded.vision is not None
    assert loaded.config.layer_types == ["sliding_attention", "full_attention"] and loaded.config.sliding_window == 24
    assert not loaded.vision.uses_mrope


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_processor_matches_gemma3_processor(name: str, loaded, reference) -> None:
    """Pixels as Gemma3ImageProcessor makes them, ids as Gemma3Processor expands them (its "\\n\\n" merged with the
    text beside it as the tokenizer merges it), the soft tokens where its token_type_ids put them."""
    processor, _ = reference
    messages = CONVERSATIONS[name]
    pictures = images()[:_count_images(messages)]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = processor(text=text, images=pictures, return_tensors="np")
    got = loaded.vision.processor.process(loaded.tokenizer.encode(text, add_special_tokens=False), pictures)
    assert got.token_ids == want["input_ids"][0].tolist()
    assert np.concatenate([f.positions for f in got.features]).tolist() == \
        np.flatnonzero(want["token_type_ids"][0]).tolist()
    assert all(f.bidirectional and f.num_embeds == 16 for f in got.features)
    pixels = np.stack([f.data["pixel_values"] for f in got.features])
    assert pixels.dtype == np.float32 and pixels.shape == want["pixel_values"].shape
    assert np.abs(pixels - want["pixel_values"]).max() <= 1e-6


def test_processor_ids_with_a_sentencepiece_vocabulary(tmp_path: Path) -> None:
    """The same expansion with a vocabulary as Gemma's is made (SentencePiece BPE, byte fallback, spaces split
    off as "▁", its BOS added by the tokenizer itself): tests/fixtures/gguf_convert.py's tiny Gemma tokenizer."""
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    from runlm.formats.tokenizer import Tokenizer
    from tests.fixtures.gguf_convert import gemma_sentencepiece_gguf
    from tests.fixtures.vlm.gemma3 import CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(str(gemma_sentencepiece_gguf().parent), extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    tok.save_pretrained(str(tmp_path))
    size = {"height": 64, "width": 64}
    reference = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size=size), tokenizer=tok,
                                chat_template=CHAT_TEMPLATE, image_seq_length=16)
    ours = Tokenizer.from_dir(tmp_path)
    processor = gemma3.Gemma3ImageProcessor({"size": size}, {"mm_tokens_per_image": 16}, ours, 64)
    for messages in CONVERSATIONS.values():
        pictures = images()[:_count_images(messages)]
        text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # the template writes the BOS: the processor would add a second one
        want = reference(text=text, images=pictures, add_special_tokens=False)["input_ids"][0]
        assert processor.process(ours.encode(text, add_special_tokens=False), pictures).token_ids == want


def test_every_size_of_image_resizes_as_transformers_does(loaded, reference) -> None:
    processor, _ = reference
    pictures = images()
    want = processor.image_processor(pictures, return_tensors="np")["pixel_values"]
    for image, pixels in zip(pictures, want):
        assert np.abs(loaded.vision.processor.pixels(image) - pixels).max() <= 1e-6


def test_an_image_is_known_by_its_pixels(loaded) -> None:
    processor = loaded.vision.processor
    ids = loaded.tokenizer.encode("<start_of_image>", add_special_tokens=False)
    a, b = picture(96, 64, 0), picture(96, 64, 1)
    as_png = open_image(png_bytes(a))
    keys = [processor.process(ids, [img]).features[0].hash for img in (a, as_png, b)]
    assert keys[0] == keys[1] != keys[2]


def test_each_image_needs_its_placeholder(loaded) -> None:
    ids = loaded.tokenizer.encode("<start_of_image> and <start_of_image>", add_special_tokens=False)
    with pytest.raises(ImageError, match="2 image placeholders"):
        loaded.vision.processor.process(ids, [picture()])
    with pytest.raises(ImageError, match="0 image placeholders"):
        loaded.vision.processor.process(loaded.tokenizer.encode("hi"), [picture()])
    assert loaded.vision.processor.process(loaded.tokenizer.encode("hi"), []).token_ids == \
        loaded.tokenizer.encode("hi")


def test_ids_a_client_wrote_stay_as_written(loaded) -> None:
    """Around an image only the newlines are merged; ids that are not the tokenizer's own encoding of their
    text are kept, with the newlines' ids beside them."""
    tok = loaded.tokenizer
    boi = tok.hf.token_to_id("<start_of_image>")
    newline = tok.encode("\n", add_special_tokens=False)
    odd = [*newline, *newline, *newline]  # "\n\n\n" as three tokens: the tokenizer writes one
    got = loaded.vision.processor.process([*odd, boi, *odd], [picture()]).token_ids
    nn = tok.encode("\n\n", add_special_tokens=False)
    assert got[:4] == [*odd, *nn] and got[-4:] == [*nn, *odd]


@pytest.mark.parametrize("setting", [{"do_pan_and_scan": True}, {"do_resize": False},
                                     {"size": {"shortest_edge": 64}}, {"size": {"height": 32, "width": 32}}])
def test_refuses_processor_settings_it_does_not_follow(setting: dict, model_dir: Path, loaded) -> None:
    import json

    from runlm.models.weights import read_hf_config

    preprocessor = {**json.loads((model_dir / "processor_config.json").read_text())["image_processor"], **setting}
    processor = gemma3.Gemma3ImageProcessor
    with pytest.raises(ModelFormatError):
        processor(preprocessor, read_hf_config(model_dir), loaded.tokenizer, 64)


def test_tower_and_projector_match_get_image_features(loaded, reference) -> None:
    processor, model = reference
    pictures = images()
    ids = loaded.tokenizer.encode("<start_of_image>" * len(pictures), add_special_tokens=False)
    features = loaded.vision.processor.process(ids, pictures).features
    got = loaded.vision.encode(features)
    with torch.no_grad():
        want = model.get_image_features(torch.from_numpy(processor.image_processor(
            pictures, return_tensors="np")["pixel_values"])).pooler_output
    assert [tuple(g.shape) for g in got] == [(16, 64)] * len(pictures) and all(g.dtype == torch.float32 for g in got)
    assert (torch.stack(got) - want).abs().max().item() <= 1e-4
    assert want.abs().mean().item() > 0.5  # the projector is not the zeros transformers initializes it to


def _reference_greedy(reference, messages: list[dict], pictures: list, steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and each step's log-probabilities, the whole sequence run again each step
    (token_type_ids mark the image tokens: their bidirectional mask)."""
    processor, model = reference
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=pictures, return_tensors="pt")
    ids, types = inputs["input_ids"], inputs["token_type_ids"]
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids, pixel_values=inputs["pixel_values"], token_type_ids=types,
                           attention_mask=torch.ones_like(ids)).logits[0, -1]
            logprobs.append(torch.log_softmax(logits.float(), -1))
            tokens.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], 1)
            types = torch.cat([types, torch.zeros(1, 1, dtype=types.dtype)], 1)
    return tokens, torch.stack(logprobs)


def _chat(messages: list[dict], pictures: list) -> list[dict]:
    """The conversation with the images in its image parts, as a client sends them (PIL images, PNG bytes)."""
    it = iter(pictures)
    out = []
    for m in messages:
        if isinstance(m["content"], list):
            parts = []
            for p in m["content"]:
                if p["type"] == "image":
                    image = next(it)
                    parts.append({"type": "image", "image": png_bytes(image) if len(parts) % 2 else image})
                else:
                    parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out


@pytest.mark.parametrize("name, chunk", [("one image", None), ("two images, text between", 7),
                                         ("system and turns", None)])
def test_chat_with_images_matches_transformers(name: str, chunk: int | None, model_dir: Path, reference) -> None:
    """Greedy tokens equal, log-probabilities within 1e-4 (2e-5 here; 0.28 with a causal mask over the image),
    prefill in one step or in chunks of 7 (an image's 16 tokens then go in one chunk), and again from the caches."""
    from runlm import LLM, SamplingParams

    messages = CONVERSATIONS[name]
    pictures = images()[:_count_images(messages)]
    want_tokens, want_logprobs = _reference_greedy(reference, messages, pictures, 20)
    llm = LLM(str(model_dir), exact_numerics=True, block_size=4, max_model_len=512, kv_cache_memory="4MiB",
              **({"max_num_batched_tokens": chunk} if chunk else {}))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5)
    out = llm.chat(_chat(messages, pictures), params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want_tokens
    assert out.logprobs is not None
    worst = max(abs(lp.logprob - want_logprobs[step, token].item())
                for step, top in enumerate(out.logprobs) for token, lp in top.items())
    assert worst <= 1e-4, worst
    again = llm.chat(_chat(messages, pictures), params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want_tokens and again.num_cached_tokens > 0


def test_the_image_reaches_the_logits(model_dir: Path) -> None:
    """Another picture, otherwise the same conversation: other logits (the image's rows are not lost)."""
    from runlm import LLM, SamplingParams

    llm = LLM(str(model_dir), exact_numerics=True, max_model_len=512, kv_cache_memory="4MiB")
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    outs = [llm.chat(_chat(CONVERSATIONS["one image"], [picture(96, 64, seed)]), params, use_tqdm=False)[0]
            for seed in (0, 5)]
    assert outs[0].outputs[0].logprobs != outs[1].outputs[0].logprobs

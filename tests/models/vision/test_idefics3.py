"""SmolVLM / Idefics3 against transformers on the tiny model (tests/fixtures/vlm/idefics3.py).

The processor: the same token ids as Idefics3Processor (tile markers, newlines, the global image) and the
same pixel values (1e-6). The tower + connector: get_image_features' rows within 1e-4. The whole model,
exact numerics: last-position logits within 1e-4 relative, 20 greedy tokens identical, through runlm.LLM.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runlm.formats.tokenizer import Tokenizer
from runlm.models.vision import idefics3
from tests.fixtures.vlm import png_bytes, test_image, vlm_dir

RTOL = 1e-4
GREEDY_TOKENS = 20
# (width, height): 2 x 2 tiles, 2 rows x 1 column, 1 x 2, a square, one smaller than a tile, a very wide one
SIZES = [(96, 64), (40, 100), (150, 60), (64, 64), (30, 20), (300, 40)]


@pytest.fixture(scope="module")
def model_dir():
    return vlm_dir("idefics3")


@pytest.fixture(scope="module")
def hf_processor(model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import Idefics3ForConditionalGeneration

    return Idefics3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def loaded(model_dir):
    from runlm.models.load import load_decoder

    return load_decoder(model_dir, exact_numerics=True)


def _messages(text: str, *images) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                         {"type": "text", "text": text}]}]


def _template_messages(text: str, n: int) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(n)), {"type": "text", "text": text}]}]


def _compare_processor(processor, hf_processor, tokenizer: Tokenizer, images, **hf_kwargs) -> None:
    prompt = hf_processor.apply_chat_template(_template_messages("What is this?", len(images)),
                                              add_generation_prompt=True)
    theirs = hf_processor(text=prompt, images=images, return_tensors="np", **hf_kwargs)
    ours = processor.process(tokenizer.encode(prompt), images)
    assert ours.token_ids == theirs["input_ids"][0].tolist()
    pixels = np.concatenate([f.data["pixel_values"] for f in ours.features])
    ref = theirs["pixel_values"][0]
    assert pixels.shape == ref.shape
    assert np.abs(pixels - ref).max() <= 1e-6
    # each image's rows are the <image> tokens of its tiles, in order, and nothing else
    ids = np.asarray(ours.token_ids)
    positions = np.concatenate([f.positions for f in ours.features])
    assert np.array_equal(positions, np.flatnonzero(ids == processor.image_token_id))
    for f in ours.features:
        assert f.num_embeds == f.data["pixel_values"].shape[0] * processor.image_seq_len
        assert not f.bidirectional


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_processor_matches_transformers(size, model_dir, hf_processor, loaded) -> None:
    image = test_image(*size, seed=sum(size))
    _compare_processor(loaded.vision.processor, hf_processor, loaded.tokenizer, [image])


def test_processor_two_images_in_one_prompt(hf_processor, loaded) -> None:
    images = [test_image(96, 64, seed=1), test_image(40, 100, seed=2)]
    _compare_processor(loaded.vision.processor, hf_processor, loaded.tokenizer, images)
    first, second = loaded.vision.processor.process(
        loaded.tokenizer.encode(hf_processor.apply_chat_template(_template_messages("Compare.", 2))), images).features
    assert first.end < second.start and first.hash != second.hash


@pytest.mark.parametrize("override", [{"do_image_splitting": False}, {"size": {"longest_edge": 64}}],
                         ids=["no-splitting", "one-tile"])
def test_processor_global_image_alone(override, model_dir, hf_processor, loaded) -> None:
    """Splitting off, or an image resized to a single tile: the global image alone, no tile markers."""
    from runlm.models.vision import processor_config

    settings = {**processor_config(model_dir), **override}
    processor = idefics3.Idefics3ImageProcessor(settings, loaded.tokenizer, loaded.vision.processor.image_token_id,
                                                loaded.vision.processor.image_seq_len)
    images = [test_image(96, 64), test_image(30, 50, seed=5)]
    _compare_processor(processor, hf_processor, loaded.tokenizer, images, **override)
    assert all(f.data["rows"] == 0 and f.num_embeds == processor.image_seq_len
               for f in processor.process(loaded.tokenizer.encode("<image><image>"), images).features)


def test_processor_refuses_a_miscount(loaded) -> None:
    from runlm.models.vision.images import ImageError

    ids = loaded.tokenizer.encode("<image> and <image>")
    with pytest.raises(ImageError, match="2 image placeholders"):
        loaded.vision.processor.process(ids, [test_image()])


def test_processor_refuses_more_tiles_than_the_tokenizer_names(model_dir, loaded) -> None:
    """Without the resize to ``size``, a wide picture could need more than the 6 x 6 tiles <row_i_col_j> name."""
    from runlm.models.vision import processor_config
    from runlm.models.vision.images import ImageError

    settings = {**processor_config(model_dir), "do_resize": False}
    processor = idefics3.Idefics3ImageProcessor(settings, loaded.tokenizer, loaded.vision.processor.image_token_id,
                                                loaded.vision.processor.image_seq_len)
    assert processor.tiles(test_image(6 * 64, 64))[1:] == (1, 6)
    with pytest.raises(ImageError, match="7 tiles"):
        processor.tiles(test_image(7 * 64, 64))


def test_tower_matches_get_image_features(hf_processor, hf_model, loaded) -> None:
    images = [test_image(96, 64, seed=7), test_image(40, 100, seed=8), test_image(30, 20, seed=9)]
    prompt = hf_processor.apply_chat_template(_template_messages("x", len(images)))
    inputs = hf_processor(text=prompt, images=images, return_tensors="pt")
    with torch.inference_mode():
        ref = hf_model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"]).pooler_output
    ref = torch.cat(list(ref))
    features = loaded.vision.processor.process(loaded.tokenizer.encode(prompt), images).features
    ours = loaded.vision.encode(features)
    assert [o.shape[0] for o in ours] == [f.num_embeds for f in features]
    ours = torch.cat(ours)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4


def test_position_ids_follow_transformers_buckets() -> None:
    """A grid of 19 patches a side buckets into positions that are not 0..18 (float32 rounding): runlm takes
    transformers' buckets, read here off Idefics3VisionEmbeddings with the position index as its embedding."""
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    for side in (8, 19, 25, 27, 32):
        emb = Idefics3VisionEmbeddings(Idefics3VisionConfig(hidden_size=1, image_size=side, patch_size=1))
        with torch.no_grad():
            emb.patch_embedding.weight.zero_()
            emb.patch_embedding.bias.zero_()
            emb.position_embedding.weight.copy_(torch.arange(side * side, dtype=torch.float32)[:, None])
            ref = emb(torch.zeros(1, 3, side, side), torch.ones(1, side, side, dtype=torch.bool))[0, :, 0]
        assert torch.equal(idefics3._position_ids(side, side), ref.long())
    assert not torch.equal(idefics3._position_ids(19, 19), torch.arange(19 * 19))


def test_text_weights_and_config() -> None:
    assert idefics3.text_weight("model.text_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert idefics3.text_weight("text_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert idefics3.text_weight("lm_head.weight") == "lm_head.weight"
    assert idefics3.text_weight("model.vision_model.post_layernorm.weight") is None
    assert idefics3.text_weight("model.connector.modality_projection.proj.weight") is None
    cfg = idefics3.text_config({"tie_word_embeddings": True, "text_config": {"hidden_size": 64}})
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] and cfg["rms_norm_eps"] == 1e-5


def _reference(hf_model, inputs: dict) -> tuple[torch.Tensor, list[int]]:
    """transformers' last-position logits for the prompt and its greedy continuation (KV cache, no EOS stop)."""
    tokens = []
    with torch.inference_mode():
        step = hf_model(**inputs, use_cache=True)
        logits = step.logits[0, -1]
        for _ in range(GREEDY_TOKENS):
            token = int(step.logits[0, -1].argmax())
            tokens.append(token)
            step = hf_model(input_ids=torch.tensor([[token]]), cache=step.past_key_values, use_cache=True)
    return logits, tokens


@pytest.mark.parametrize("shapes", [[(96, 64)], [(96, 64), (40, 100)]], ids=["one-image", "two-images"])
def test_llm_chat_matches_transformers(shapes, model_dir, hf_processor, hf_model, loaded) -> None:
    from runlm import LLM, SamplingParams
    from runlm.models.attention import ForwardContext, forward_context

    images = [test_image(w, h, seed=i + 11) for i, (w, h) in enumerate(shapes)]
    prompt = hf_processor.apply_chat_template(_template_messages("Describe the picture.", len(images)),
                                              add_generation_prompt=True)
    inputs = hf_processor(text=prompt, images=images, return_tensors="pt")
    ref_logits, ref_tokens = _reference(hf_model, dict(inputs))

    # the decoder with the tower's rows spliced in, as the engine does it
    mm = loaded.vision.processor.process(loaded.tokenizer.encode(prompt), images)
    assert mm.token_ids == inputs["input_ids"][0].tolist()
    rows = torch.cat([torch.from_numpy(f.positions) for f in mm.features])
    values = torch.cat(loaded.vision.encode(mm.features))
    ctx = ForwardContext.no_cache([len(mm.token_ids)])
    ctx.mm_embeds = (rows, values)
    with torch.inference_mode(), forward_context(ctx):
        hidden = loaded.model(torch.tensor(mm.token_ids), torch.arange(len(mm.token_ids)))
        ours = loaded.model.compute_logits(hidden)[-1]
    rel = ((ours - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert rel < RTOL, f"logits differ by {rel:.2e} relative"

    # and through runlm.LLM: encoded images in the chat, greedy through the paged KV cache
    llm = LLM(str(model_dir), block_size=4, kv_cache_memory="64MiB", max_model_len=1024, exact_numerics=True)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=1)
    out = llm.chat(_messages("Describe the picture.", *(png_bytes(i) for i in images)), params)[0]
    assert out.prompt_token_ids == mm.token_ids
    assert out.outputs[0].token_ids == ref_tokens
    first = out.outputs[0].logprobs[0][ref_tokens[0]].logprob
    assert first == pytest.approx(torch.log_softmax(ref_logits, -1)[ref_tokens[0]].item(), abs=1e-4)


def test_smolvlm_model_type_matches_smolvlm_for_conditional_generation(model_dir, hf_processor, tmp_path) -> None:
    """SmolVLM2's checkpoints say model_type smolvlm (SmolVLMForConditionalGeneration, the same tower, connector
    and prompt): the tiny model relabelled so, against transformers' SmolVLM classes."""
    import json

    from transformers import SmolVLMForConditionalGeneration

    from runlm.models.attention import ForwardContext, forward_context
    from runlm.models.load import load_decoder

    for f in model_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(model_type="smolvlm", architectures=["SmolVLMForConditionalGeneration"])
    cfg["vision_config"]["model_type"] = "smolvlm_vision"
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ref_model = SmolVLMForConditionalGeneration.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    smol = load_decoder(tmp_path, exact_numerics=True)
    images = [test_image(96, 64, seed=21), test_image(40, 100, seed=22)]
    prompt = hf_processor.apply_chat_template(_template_messages("Compare them.", 2), add_generation_prompt=True)
    inputs = hf_processor(text=prompt, images=images, return_tensors="pt")
    with torch.inference_mode():
        ref = ref_model(**inputs).logits[0, -1]
    mm = smol.vision.processor.process(smol.tokenizer.encode(prompt), images)
    ctx = ForwardContext.no_cache([len(mm.token_ids)])
    ctx.mm_embeds = (torch.cat([torch.from_numpy(f.positions) for f in mm.features]),
                     torch.cat(smol.vision.encode(mm.features)))
    with torch.inference_mode(), forward_context(ctx):
        ours = smol.model.compute_logits(smol.model(torch.tensor(mm.token_ids), torch.arange(len(mm.token_ids))))[-1]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < RTOL

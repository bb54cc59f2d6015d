"""Qwen2.5-VL against transformers on the tiny model (tests/fixtures/vlm/qwen2_5_vl.py): the processor's pixel
values, grids, expanded ids and M-RoPE positions (get_rope_index), the tower's rows for several images in one
pass (get_image_features), M-RoPE rotation (Qwen2_5_VLRotaryEmbedding + apply_rotary_pos_emb), the text config
of both config layouts, and a chat with images through runlm.LLM (logprobs and greedy tokens)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from runlm.models.config import ModelConfig
from runlm.models.vision import qwen2_5_vl as qwen
from runlm.models.vision.images import ImageError
from tests.fixtures.vlm import png_bytes, test_image, vlm_dir
from tests.fixtures.vlm.qwen2_5_vl import hf_processor

# a min_pixels image (upscaled), two ordinary ones of different shapes, a max_pixels one (downscaled)
IMAGES = [(96, 64, 0), (50, 120, 1), (12, 10, 2), (400, 260, 3)]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return vlm_dir("qwen2_5_vl")


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vision(model_dir: Path) -> qwen.Qwen2_5_VLVision:
    from safetensors.torch import load_file

    from runlm.formats.tokenizer import Tokenizer

    cfg = json.loads((model_dir / "config.json").read_text())
    pre = json.loads((model_dir / "preprocessor_config.json").read_text())
    weights = [(k, v) for k, v in load_file(model_dir / "model.safetensors").items() if qwen.text_weight(k) is None]
    return qwen.build(cfg, pre, weights, Tokenizer.from_dir(model_dir))


def _conversation(n_images: int, text: str = "What is in these pictures?") -> list[dict]:
    parts = [{"type": "image"}] * n_images
    return [{"role": "user", "content": [parts[0], {"type": "text", "text": text}, *parts[1:]]}]


def _hf_inputs(images: list, messages: list[dict]):
    processor = hf_processor()
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, processor(images=images, text=[text], return_tensors="pt")


def test_processor_matches_transformers(vision, hf_model, model_dir: Path) -> None:
    from runlm.formats.tokenizer import Tokenizer

    images = [test_image(*i) for i in IMAGES]
    text, ref = _hf_inputs(images, _conversation(len(images)))
    ids = Tokenizer.from_dir(model_dir).hf.encode(text, add_special_tokens=False).ids
    mm = vision.processor.process(ids, images)
    assert mm.token_ids == ref["input_ids"][0].tolist()
    pixels = np.concatenate([f.data["pixel_values"] for f in mm.features])
    assert pixels.shape == tuple(ref["pixel_values"].shape)
    assert np.abs(pixels - ref["pixel_values"].numpy()).max() <= 1e-6
    grids = np.stack([f.data["grid_thw"] for f in mm.features])
    assert (grids == ref["image_grid_thw"].numpy()).all()
    assert len({tuple(g) for g in grids.tolist()}) == len(images)  # min and max pixels both took effect
    pad = hf_model.config.image_token_id
    for f in mm.features:
        assert all(mm.token_ids[p] == pad for p in f.positions)
        assert f.num_embeds == int(np.prod(f.data["grid_thw"])) // 4
    assert sum(f.num_embeds for f in mm.features) == mm.token_ids.count(pad)
    positions, delta = hf_model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"],
                                                     image_grid_thw=ref["image_grid_thw"])
    assert mm.mrope_positions is not None and mm.mrope_positions.dtype == np.int64
    assert (mm.mrope_positions == positions[:, 0].numpy()).all()
    assert mm.mrope_delta == int(delta) < 0


def test_processor_placeholders_and_refusals(vision) -> None:
    p = vision.processor
    pad, image = p.image_token_id, test_image(96, 64)
    once = p.process([5, pad, 6], [image])
    n = once.features[0].num_embeds
    assert once.token_ids == [5, *[pad] * n, 6]
    # ids already expanded (a run of exactly the image's tokens) are kept as they are
    again = p.process(once.token_ids, [image])
    assert again.token_ids == once.token_ids and (again.mrope_positions == once.mrope_positions).all()
    assert again.features[0].hash == once.features[0].hash
    with pytest.raises(ImageError, match="2 image placeholders and 1 images"):
        p.process([pad, 7, pad], [image])
    with pytest.raises(ImageError, match="placeholder of 2 tokens"):
        p.process([pad, pad], [image])
    with pytest.raises(ImageError, match="aspect ratio"):
        p.process([pad], [test_image(401, 2)])
    other = p.process([pad], [test_image(96, 64, seed=5)]).features[0]
    assert other.hash != once.features[0].hash


def test_tower_matches_transformers_for_several_images_in_one_pass(vision, hf_model) -> None:
    images = [test_image(*i) for i in IMAGES]
    _, ref = _hf_inputs(images, _conversation(len(images)))
    mm = vision.processor.process(ref["input_ids"][0].tolist(), images)
    with torch.no_grad():
        expected = hf_model.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"]).pooler_output
    rows = vision.encode(mm.features)
    assert [r.shape for r in rows] == [e.shape for e in expected]
    for got, want in zip(rows, expected):
        assert got.dtype == torch.float32
        assert (got - want).abs().max().item() <= 1e-4
    alone = vision.encode([mm.features[1]])[0]  # one image alone: the same rows as beside the others
    assert (alone - rows[1]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("head_dim,section", [(16, [2, 3, 3]), (128, [16, 24, 24])])
def test_mrope_rotation_matches_transformers(head_dim: int, section: list[int]) -> None:
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, apply_rotary_pos_emb

    from runlm.models.rope import RotaryEmbedding

    heads, kv_heads, t = 4, 2, 37
    hf_cfg = Qwen2_5_VLTextConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                   "mrope_section": section})
    cfg = ModelConfig.from_hf(qwen.text_config({"model_type": "qwen2_5_vl", "text_config": hf_cfg.to_dict()}))
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, 64)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(t, heads, head_dim, generator=gen), torch.randn(t, kv_heads, head_dim, generator=gen)
    positions = torch.randint(0, 300, (3, t), generator=gen)  # past the table's 64: it grows
    cos, sin = Qwen2_5_VLRotaryEmbedding(hf_cfg)(q, positions[:, None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = rope(positions, q, k)
    # (numpy's float32 powers in runlm.models.rope_freqs differ from torch's by an ulp in a few frequencies: at
    # position ~300 that is ~6e-5 of the angle, as for every RoPE model)
    assert (got_q - want_q[0].transpose(0, 1)).abs().max().item() <= 1e-4
    assert (got_k - want_k[0].transpose(0, 1)).abs().max().item() <= 1e-4
    # [T] positions: plain RoPE, and the same as three equal rows
    plain = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, None, 64)
    flat = positions[0]
    for a, b in zip(rope(flat, q, k), plain(flat, q, k)):
        assert torch.equal(a, b)
    for a, b in zip(rope(flat.expand(3, -1), q, k), plain(flat, q, k)):
        assert torch.equal(a, b)


def test_text_config_of_both_layouts_and_weight_names(model_dir: Path) -> None:
    from transformers import Qwen2_5_VLConfig

    nested = json.loads((model_dir / "config.json").read_text())
    # the layout of the Hub's Qwen/Qwen2.5-VL-*-Instruct files: the text model's keys at the top, mrope in rope_scaling
    text = {k: v for k, v in nested["text_config"].items() if k not in ("rope_parameters", "model_type")}
    flat = {**{k: v for k, v in nested.items() if k != "text_config"}, **text, "rope_theta": 10000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    # (transformers writes into the dicts it is given)
    assert Qwen2_5_VLConfig(**copy.deepcopy(flat)).text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    a, b = (ModelConfig.from_hf(qwen.text_config(c)) for c in (nested, flat))
    assert a == b
    assert a.family == "qwen2" and a.attention_bias and a.tie_word_embeddings and a.sliding_window is None
    assert a.rope_theta == 10000.0 and a.rope_scaling == {"rope_type": "mrope", "mrope_section": [2, 3, 3]}
    assert a.eos_token_ids == [nested["text_config"]["eos_token_id"]]
    # no rope_theta anywhere: Qwen2.5-VL's own default, not Llama's
    bare = {k: v for k, v in flat.items() if k != "rope_theta"}
    assert ModelConfig.from_hf(qwen.text_config(bare)).rope_theta == 1000000.0
    # the Hub's vision_config names: spatial_patch_size, in_chans
    hub_vision = {**{k: v for k, v in nested["vision_config"].items() if k not in ("patch_size", "in_channels")},
                  "spatial_patch_size": 7, "in_chans": 3}
    shapes = {n: p.shape for n, p in qwen.Qwen2_5_VisionTransformer(hub_vision).named_parameters()}
    assert shapes == {n: p.shape for n, p in qwen.Qwen2_5_VisionTransformer(nested["vision_config"]).named_parameters()}
    assert shapes["patch_embed.proj.weight"] == (32, 3, 2, 7, 7)
    assert qwen.text_weight("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert qwen.text_weight("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert qwen.text_weight("lm_head.weight") == "lm_head.weight"
    assert qwen.text_weight("visual.blocks.0.attn.qkv.weight") is None
    assert qwen.text_weight("model.visual.merger.ln_q.weight") is None


def test_chat_with_images_matches_transformers(model_dir: Path, hf_model) -> None:
    from runlm import LLM, SamplingParams

    images = [test_image(96, 64, 0), test_image(50, 120, 1)]
    messages = _conversation(2)
    _, ref = _hf_inputs(images, messages)
    with torch.no_grad():
        out = hf_model.generate(**ref, max_new_tokens=20, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
    want_tokens = out.sequences[0, ref["input_ids"].shape[1]:].tolist()
    want_logprobs = torch.stack(out.logits)[:, 0].float().log_softmax(-1)
    llm = LLM(str(model_dir), exact_numerics=True, kv_cache_memory="64MiB", max_model_len=1024)
    chat = [{"role": "user", "content": [{"type": "image", "image": png_bytes(images[0])},
                                         messages[0]["content"][1],
                                         {"type": "image_pil", "image_pil": images[1]}]}]
    got = llm.chat(chat, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5))[0]
    assert got.prompt_token_ids == ref["input_ids"][0].tolist()
    assert list(got.outputs[0].token_ids) == want_tokens
    for step, top in enumerate(got.outputs[0].logprobs):
        for token, lp in top.items():
            assert abs(lp.logprob - want_logprobs[step, token].item()) <= 1e-4
    # the picture and its M-RoPE positions matter: another image changes the first step's distribution
    other = llm.chat([{"role": "user", "content": [{"type": "image", "image": test_image(96, 64, 7)},
                                                   *chat[0]["content"][1:]]}],
                     SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    assert other.outputs[0].logprobs[0] != got.outputs[0].logprobs[0]

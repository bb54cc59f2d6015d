"""Vision-language models from GGUF files: a text GGUF plus llama.cpp's mmproj GGUF, both written by llama.cpp's
converters (tests/fixtures/vlm/gguf.py) from the tiny transformers models.

* runlm.models.vision.mmproj translates the projector file back into the family's HF config, processor config and
  checkpoint tensors. SmolVLM (idefics3) in f32: every tensor the safetensors' bit for bit, the tower's rows
  equal (0.0; <= 1e-5 asked). Where the converter stores tensors in F16 whatever it is asked (Gemma 3's input
  projection; LLaVA's legacy script: the patch convolution and the projector) and in f16 files: within 1e-3 of
  the rows' scale; q8_0 files: within 5e-2. The processor's token ids and pixels are the directory's where the
  file says all its processor needs (SmolVLM, Gemma 3; LLaVA's crop size is not in the file).
* End to end: the f32 text GGUF + mmproj answers a chat with an image with the directory's greedy tokens (torch
  runner, exact mode); a q8_0 text GGUF + mmproj on the native runner (which takes block types, not F32
  matrices) answers as the torch runner's fast path on the same files, whose layer loop it reproduces bit for
  bit, and a second turn on the image runs no tower work.
* Bad files: a wrong shape, an unknown tensor, metadata out of range are refused before any tensor is read.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from runlm.formats import ModelFormatError
from runlm.formats.gguf import GGUFFile
from tests.fixtures.default_run import default_run
from tests.fixtures.vlm import png_bytes
from tests.fixtures.vlm import test_image as make_image

FAMILIES = [f for f in ("idefics3", "gemma3", "llava", "qwen2_5_vl")
            if importlib.util.find_spec(f"runlm.models.vision.{f}") is not None
            and importlib.util.find_spec(f"tests.fixtures.vlm.{f}") is not None]
pytestmark = pytest.mark.skipif(not FAMILIES, reason="no vision family with a fixture on this branch yet")

GREEDY_TOKENS = 12
# the families whose f32 mmproj holds every tensor in F32 (the others keep some in F16 whatever they are asked)
ALL_F32 = {"idefics3", "qwen2_5_vl"}
# the families whose mmproj says everything their processor needs (Qwen2.5-VL's pixel bounds are clip.cpp's, which
# the small test images fall within)
SAME_PROCESSOR = {"idefics3", "gemma3", "qwen2_5_vl"}
# what the file does not carry, set in the directory's config as clip.cpp computes it
FILE_SETTINGS = {"qwen2_5_vl": {"window_size": 112}}
# text GGUFs runlm does not read yet
NO_TEXT_GGUF = {"qwen2_5_vl": "runlm reads no qwen2vl text GGUF yet (M-RoPE sections from the file)"}
# the families whose text model the native runner runs (Gemma's is the torch runner's)
NATIVE_TEXT = {"idefics3", "llava"}  # (Qwen2.5-VL's needs M-RoPE)


def _needs_native(family) -> None:
    from runlm.native import kernels

    if _name(family) not in NATIVE_TEXT:
        pytest.skip(f"the {_name(family)} text model is not on the native runner")
    if not kernels.available():
        pytest.skip("the native kernels are unavailable here")


def _name(family) -> str:
    return family.__name__.rsplit(".", 1)[-1]


def _placeholder(processor) -> int:
    """The token a chat template writes for an image: Gemma 3's <start_of_image>, else the family's image token."""
    return int(getattr(processor, "boi", None) or processor.image_token_id)


def _hf_weights(path: Path, family) -> dict:
    from safetensors.torch import load_file

    return {n: t for n, t in load_file(str(path / "model.safetensors")).items() if family.text_weight(n) is None}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    from runlm.models.vision import family_module

    return family_module(request.param)


@pytest.fixture(scope="module")
def files(family):
    from tests.fixtures.vlm.gguf import vlm_gguf

    return vlm_gguf(_name(family), "f32")


@pytest.fixture(scope="module")
def model_dir(family):
    from tests.fixtures.vlm import vlm_dir

    return vlm_dir(_name(family))


@default_run("llava", "qwen2_5_vl")
def test_f32_mmproj_tensors_are_the_checkpoints(family, files, model_dir) -> None:
    """Every tensor of the file under its checkpoint name, equal (F32) or within F16's rounding; LLaVA's legacy
    files hold the tower up to the feature layer only, without the final norm it does not use."""
    from runlm.models.vision import mmproj

    hf_config, preprocessor, weights = mmproj.as_hf(GGUFFile(files[1]), family)
    ours = dict(weights)
    theirs = _hf_weights(model_dir, family)
    if _name(family) == "llava":
        kept = hf_config["vision_config"]["num_hidden_layers"] - 1  # read at -2: the last one is never built
        assert {n for n in theirs if n not in ours} == {
            n for n in theirs if "post_layernorm" in n or any(f".layers.{i}." in n for i in range(kept, 64))}
    else:
        assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and tensor.shape == theirs[name].shape, name
        tol = 0.0 if _name(family) in ALL_F32 else 1e-3 * max(theirs[name].abs().max().item(), 1.0)
        assert (tensor - theirs[name]).abs().max().item() <= tol, name
    cfg = json.loads((model_dir / "config.json").read_text())
    for key, value in hf_config["vision_config"].items():
        if (key not in ("model_type", "num_hidden_layers", *FILE_SETTINGS.get(_name(family), {}))
                and key in cfg["vision_config"]):
            assert cfg["vision_config"][key] == value, key


def _reference(family, model_dir: Path, tokenizer):
    """The family's tower from the safetensors directory."""
    from runlm.models.vision import processor_config

    hf_config = json.loads((model_dir / "config.json").read_text())
    hf_config["vision_config"].update(FILE_SETTINGS.get(_name(family), {}))
    return family.build(hf_config, processor_config(model_dir), list(_hf_weights(model_dir, family).items()),
                        tokenizer)


@default_run("idefics3-f32-1e-05", "gemma3-f32-1e-05", "llava-q8_0-0.05", "qwen2_5_vl-f16-0.001")
@pytest.mark.parametrize("outtype,tol", [("f32", 1e-5), ("f16", 1e-3), ("q8_0", 5e-2)])
def test_mmproj_tower_matches_safetensors(outtype, tol, family, model_dir) -> None:
    from runlm.formats.tokenizer import Tokenizer
    from runlm.models.vision import build_mmproj
    from tests.fixtures.vlm.gguf import vlm_gguf

    if outtype == "f32" and _name(family) not in ALL_F32:
        tol = 1e-3
    text, mmproj_file = vlm_gguf(_name(family), outtype)
    ref = _reference(family, model_dir, Tokenizer.from_dir(model_dir))
    ours = build_mmproj(GGUFFile(mmproj_file), Tokenizer.from_gguf(GGUFFile(text)))
    images = [make_image(96, 64, seed=1), make_image(40, 100, seed=2)]
    placeholder = _placeholder(ref.processor)
    prompt = [1, placeholder, 5, placeholder, 7]
    a = ref.processor.process(prompt, images)
    if _name(family) in SAME_PROCESSOR:
        b = ours.processor.process(prompt, images)
        assert b.token_ids == a.token_ids
        for fa, fb in zip(a.features, b.features):
            assert np.array_equal(fa.positions, fb.positions)
            assert np.abs(fa.data["pixel_values"] - fb.data["pixel_values"]).max() <= 1e-6
    for ea, eb in zip(ref.encode(a.features), ours.encode(a.features)):  # the same pixels through both towers
        assert ea.shape == eb.shape
        scale = max(ea.abs().max().item(), 1.0)
        assert (ea - eb).abs().max().item() <= tol * scale


def test_native_decoder_takes_embedding_rows_over_the_token_embeddings(family) -> None:
    """Rows given as embeddings are the same step as the tokens whose embeddings they are, bit for bit (q8_0
    table: the rows given are its dequantized rows); rows outside the step are refused."""
    from runlm.models.native import load_native

    _needs_native(family)
    text = _gguf_files(family, "q8_0")[0]
    loaded = load_native(text)
    assert loaded is not None
    decoder = loaded.model.decoder
    cfg = loaded.config
    t = 9
    caches = [(np.zeros((64, cfg.num_kv_heads, cfg.head_dim), np.float32),
               np.zeros((64, cfg.num_kv_heads, cfg.head_dim), np.float32)) for _ in range(cfg.num_layers)]
    decoder.set_kv_caches(caches)
    ids = np.arange(100, 100 + t, dtype=np.int64)
    slots = np.arange(t, dtype=np.int64)
    lens = np.array([t], dtype=np.int64)

    def run(ids, embeds=None):
        return decoder.forward(ids, slots, slots, lens, lens, slots, np.empty((t, cfg.hidden_size), np.float32),
                               embeds).copy()

    table = loaded.model.gguf.load_array("token_embd.weight")
    rows = np.array([2, 3, 7], dtype=np.int64)
    swapped = ids.copy()
    swapped[rows] = [500, 501, 502]
    want = run(swapped)
    assert not np.array_equal(want, run(ids))
    got = run(ids, (rows, np.ascontiguousarray(table[[500, 501, 502]])))
    assert np.array_equal(got, want)
    assert np.array_equal(run(ids, (rows[:0], np.empty((0, cfg.hidden_size), np.float32))), run(ids))
    with pytest.raises(ValueError, match="outside the step"):
        run(ids, (np.array([t], dtype=np.int64), np.zeros((1, cfg.hidden_size), np.float32)))


def _generate(llm, image) -> list[int]:
    """One image between text tokens, as token ids (whatever the chat template)."""
    from runlm import SamplingParams

    tok, engine = llm.get_tokenizer(), llm.engine
    ids = [*tok.encode("User:", add_special_tokens=False), _placeholder(engine.vision.processor),
           *tok.encode(" What is in this picture?\nAssistant:", add_special_tokens=False)]
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": png_bytes(image)}},
                       SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True))
    return list(out[0].outputs[0].token_ids)


def _chat(llm, image) -> list[int]:
    from runlm import SamplingParams

    messages = [{"role": "user", "content": [{"type": "image", "image": png_bytes(image)},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    out = llm.chat(messages, SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True))
    return list(out[0].outputs[0].token_ids)


def _gguf_files(family, outtype: str) -> tuple[Path, Path]:
    from tests.fixtures.vlm.gguf import vlm_gguf

    return vlm_gguf(_name(family), outtype)


def test_f32_gguf_and_mmproj_match_the_safetensors_model_exactly(family, files, model_dir) -> None:
    """The torch runner in exact mode on the text GGUF (f32) + mmproj: the same greedy tokens as on the directory."""
    from runlm import LLM

    if _name(family) not in SAME_PROCESSOR or _name(family) in FILE_SETTINGS:
        pytest.skip("the file does not say all the directory's settings")
    if _name(family) in NO_TEXT_GGUF:
        pytest.skip(NO_TEXT_GGUF[_name(family)])
    image = make_image(96, 64, seed=3)
    want = _chat(LLM(str(model_dir), exact_numerics=True), image)
    gguf = LLM(str(files[0]), mmproj=str(files[1]), exact_numerics=True)
    assert not gguf.engine.native and gguf.engine.modalities == ("text", "image")
    assert _chat(gguf, image) == want


def test_native_runner_splices_image_rows_as_the_torch_runner_does(family, files, monkeypatch) -> None:
    """A q8_0 text GGUF + the f32 mmproj on the native runner (the native kernels take F16 and block types, not
    F32 matrices) against the torch runner's fast path on the same files, whose fused layer loop the native
    decoder reproduces bit for bit: the same greedy tokens; a second turn on the image runs no tower work."""
    from runlm import LLM

    _needs_native(family)
    text = _gguf_files(family, "q8_0")[0]
    image = make_image(96, 64, seed=3)
    native = LLM(str(text), mmproj=str(files[1]), kv_cache_dtype="fp32")  # the torch runner's cache, to the bit
    assert native.engine.native, "the text GGUF runs on the native runner"
    assert native.engine.modalities == ("text", "image")
    got = _generate(native, image)
    encoded = native.engine.encoder_cache.images_encoded
    assert encoded == 1
    assert _generate(native, image) == got  # the second turn: the encoder cache has the image
    assert native.engine.encoder_cache.images_encoded == encoded
    monkeypatch.setenv("RUNLM_NATIVE_RUNNER", "0")
    torch_llm = LLM(str(text), mmproj=str(files[1]))
    assert not torch_llm.engine.native
    assert _generate(torch_llm, image) == got
    from runlm import SamplingParams

    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    assert (native.generate("Hello there", params)[0].outputs[0].token_ids  # text alone: unchanged
            == torch_llm.generate("Hello there", params)[0].outputs[0].token_ids)
    monkeypatch.delenv("RUNLM_NATIVE_RUNNER")
    # prefill in chunks of 8 tokens: every image's rows land in several steps, each step given its slice
    chunked = LLM(str(text), mmproj=str(files[1]), max_num_batched_tokens=8, kv_cache_dtype="fp32")
    assert chunked.engine.native
    assert _generate(chunked, image) == got


def test_pixtral_mmproj_reads_back_unpermuted() -> None:
    """Pixtral-12B's mmproj (projector type pixtral): the converter permuted the q/k rows for ggml's RoPE; read
    back, every tensor is the checkpoint's and the tower's rows equal the directory's."""
    if (importlib.util.find_spec("runlm.models.vision.pixtral") is None
            or importlib.util.find_spec("tests.fixtures.vlm.llava") is None):
        pytest.skip("no Pixtral family on this branch yet")
    from tests.fixtures.vlm import llava as llava_fixture

    if not hasattr(llava_fixture, "pixtral_dir"):
        pytest.skip("no Pixtral fixture on this branch yet")
    from runlm.formats.tokenizer import Tokenizer
    from runlm.models.vision import mmproj, pixtral, processor_config
    from tests.fixtures.vlm.gguf import pixtral_gguf

    try:
        _, mmproj_file = pixtral_gguf("f32")
    except RuntimeError as exc:  # the converter maps multi_modal_projector.linear_N only for N < the tower's layers
        if "Can not map tensor" in str(exc):
            pytest.skip("convert_hf_to_gguf.py cannot map a Pixtral tower of fewer than 3 layers")
        raise
    source = llava_fixture.pixtral_dir()
    hf_config, preprocessor, weights = mmproj.as_hf(GGUFFile(mmproj_file), None)
    ours = dict(weights)
    theirs = {n: t for n, t in _hf_weights(source, pixtral).items()}
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert (tensor - theirs[name]).abs().max().item() == 0.0, name
    tokenizer = Tokenizer.from_dir(source)
    ours_model = pixtral.build(hf_config, preprocessor, ours.items(), tokenizer, llava=True)
    ref = pixtral.build(json.loads((source / "config.json").read_text()), processor_config(source),
                        theirs.items(), tokenizer, llava=True)
    image_id = tokenizer.hf.token_to_id(pixtral.IMAGE_TOKEN)
    a = ref.processor.process([1, image_id, 5], [make_image(96, 64, seed=1)])
    b = ours_model.processor.process([1, image_id, 5], [make_image(96, 64, seed=1)])
    assert a.token_ids == b.token_ids
    assert np.abs(a.features[0].data["pixel_values"] - b.features[0].data["pixel_values"]).max() <= 1e-6
    assert (ref.encode(a.features)[0] - ours_model.encode(a.features)[0]).abs().max().item() <= 1e-5


# ---- bad files ----------------------------------------------------------------------------------------------

def _rewrite(src: Path, dst: Path, metadata: dict | None = None, rename: dict | None = None,
             reshape: dict | None = None) -> Path:
    """A copy of an mmproj file with metadata changed, tensors renamed or reshaped (gguf-py's writer)."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = (metadata or {}).get(field.name, field.contents())
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(field.name, value)
        else:
            writer.add_key_value(field.name, value, vtype)
    for t in reader.tensors:
        data = np.array(t.data)
        shape = (reshape or {}).get(t.name)
        if shape is not None:
            data = np.resize(data, shape)
        writer.add_tensor((rename or {}).get(t.name, t.name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize("change,message", [
    (dict(metadata={"clip.vision.block_count": 100000}), "block_count"),
    (dict(metadata={"clip.vision.attention.head_count": 5}), "multiple"),
    (dict(metadata={"clip.vision.image_mean": [0.5, 0.5]}), "image_mean"),
    (dict(rename={"v.blk.0.ln1.weight": "v.something_else.weight"}), "something_else"),
    (dict(reshape={"v.blk.0.attn_q.weight": (8, 8)}), "attn_q"),
    (dict(metadata={"clip.projector_type": "resampler"}), "resampler"),
])
def test_bad_mmproj_files_are_refused(change, message, files, family, tmp_path) -> None:
    from runlm.models.vision import mmproj

    bad = _rewrite(files[1], tmp_path / "mmproj-bad.gguf", **change)
    with pytest.raises(ModelFormatError, match=message):
        mmproj.as_hf(GGUFFile(bad), None)


def test_a_text_gguf_is_not_an_mmproj(files) -> None:
    from runlm.models.vision import mmproj

    with pytest.raises(ModelFormatError, match="not an mmproj"):
        mmproj.clip_vision(GGUFFile(files[0]))


def test_find_mmproj_beside_the_model(files, tmp_path) -> None:
    from runlm.models.vision.mmproj import find_mmproj, is_mmproj

    assert is_mmproj(files[1]) and not is_mmproj(files[0])
    assert find_mmproj(files[0]) == files[1]
    assert find_mmproj(files[0].parent) == files[1]
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "model.gguf").symlink_to(files[0])
    assert find_mmproj(lone / "model.gguf") is None
    (lone / "mmproj-a.gguf").symlink_to(files[1])
    assert find_mmproj(lone / "model.gguf") == lone / "mmproj-a.gguf"
    shutil.copy(files[1], lone / "b.mmproj")
    assert find_mmproj(lone / "model.gguf") is None  # two: ambiguous

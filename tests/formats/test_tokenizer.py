"""runlm.formats.tokenizer against transformers' own GGUF tokenizer conversion, on a varied corpus.

The reference for each GGUF is ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` (saved once). Our GGUF
metadata comes from a tiny ``gguf.GGUFReader`` helper here, so these tests do not depend on
runlm.formats.gguf.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from runlm.formats import ModelFormatError
from runlm.formats.tokenizer import IncrementalDetokenizer, Tokenizer, bytes_to_unicode
from tests.fixtures.default_run import default_run
from tests.formats.strings import STRINGS

NAMES = ("smollm2", "tinycoder")


def _gguf_path(name: str) -> Path:
    from tests.fixtures import models

    try:
        return models.smollm2_gguf() if name == "smollm2" else models.tinycoder_gguf()
    except RuntimeError as exc:  # the model package is not installed
        pytest.skip(str(exc))


def read_metadata(path: Path) -> dict[str, Any]:
    """The tokenizer keys of a GGUF as plain Python values (what GGUFFile.metadata holds)."""
    import gguf

    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items()
            if k.startswith(("tokenizer.", "general.architecture"))}


_CACHE: dict[tuple[str, str], Any] = {}


def ours(name: str) -> Tokenizer:
    if ("ours", name) not in _CACHE:
        path = _gguf_path(name)
        _CACHE["ours", name] = Tokenizer.from_gguf(SimpleNamespace(metadata=read_metadata(path), path=path))
    return _CACHE["ours", name]


def reference(name: str) -> Any:
    if ("ref", name) not in _CACHE:
        from transformers import AutoTokenizer

        from tests.fixtures.models import gguf_tokenizer_dir

        # (transformers' reading of the GGUF, saved once: tests/fixtures/models.gguf_tokenizer_dir)
        _CACHE["ref", name] = AutoTokenizer.from_pretrained(str(gguf_tokenizer_dir(_gguf_path(name))))
    return _CACHE["ref", name]


@pytest.fixture(scope="module", params=NAMES)
def pair(request: pytest.FixtureRequest) -> tuple[str, Tokenizer, Any]:
    return request.param, ours(request.param), reference(request.param)


def _report(bad: list[Any]) -> str:
    return f"{len(bad)} mismatches, first: {bad[:3]!r}"


# -- identity with transformers ---------------------------------------------------------------------

def test_corpus_is_big_and_varied() -> None:
    assert len(STRINGS) >= 500 and len(set(STRINGS)) == len(STRINGS)
    assert "" in STRINGS and any(len(s) >= 1000 for s in STRINGS)
    assert any("\u200d" in s for s in STRINGS) and any("<|im_start|>" in s for s in STRINGS)


@default_run("smollm2-True", "tinycoder-False")
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair: tuple[str, Tokenizer, Any], add_special_tokens: bool) -> None:
    _, tok, ref = pair
    bad = [(s, tok.encode(s, add_special_tokens), ref(s, add_special_tokens=add_special_tokens)["input_ids"])
           for s in STRINGS]
    bad = [b for b in bad if b[1] != b[2]]
    assert not bad, _report(bad)


def test_decode_matches_transformers(pair: tuple[str, Tokenizer, Any]) -> None:
    _, tok, ref = pair
    rng = random.Random(7)
    sequences = [tok.encode(s) for s in STRINGS]
    # random ids too: partial UTF-8 byte tokens, special tokens in odd places
    sequences += [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(300)]
    bad = [(ids, skip) for ids in sequences for skip in (False, True)
           if tok.decode(ids, skip_special_tokens=skip) != ref.decode(ids, skip_special_tokens=skip)]
    assert not bad, _report(bad)


def test_byte_level_round_trip_is_exact() -> None:
    """decode(encode(s)) == s, except for characters whose UTF-8 bytes have no token at all.

    SmolLM2's vocabulary lacks the byte symbols for 0x04 0x06 0x13 0x14 0x16 0x1D (and the lead
    bytes F1-F4 of planes 4-16); its BPE has no unk token, so transformers (and we) drop those
    characters silently.
    """
    tok = ours("smollm2")
    table = bytes_to_unicode()
    missing = {b for b in range(256) if tok.hf.token_to_id(table[b]) is None}
    assert {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D} <= missing
    lossy = lambda s: "".join(c for c in s if not set(c.encode()) & missing)  # noqa: E731
    bad = [s for s in STRINGS if tok.decode(tok.encode(s, add_special_tokens=False)) != lossy(s)]
    assert not bad, _report(bad)
    assert sum(lossy(s) != s for s in STRINGS) < 20  # the rest round-trips exactly


def test_sentencepiece_round_trip() -> None:
    """Always equal to the reference decode. Against the input: text written with U+2581 comes back
    with spaces, and text *starting* with a space (or U+2581) loses that one space, because
    transformers' Metaspace (prepend_scheme "first") adds no prefix ▁ when the text already starts
    with one and the decoder then strips it (llama.cpp would encode " hi" as "▁▁hi")."""
    tok, ref = ours("tinycoder"), reference("tinycoder")
    differs = 0
    for s in STRINGS:
        ids = tok.encode(s, add_special_tokens=False)
        out = tok.decode(ids)
        assert out == ref.decode(ids), s
        expected = s.replace("\u2581", " ")
        expected = expected[1:] if expected.startswith(" ") else expected
        assert out == expected, s
        differs += out != s
    assert 0 < differs < 80
    assert tok.decode(tok.encode(" hi", False)) == "hi" and tok.decode(tok.encode("a  hi", False)) == "a  hi"


# -- special tokens and facts ---------------------------------------------------------------------

def test_smollm2_special_tokens() -> None:
    tok = ours("smollm2")
    im_start, im_end = tok.hf.token_to_id("<|im_start|>"), tok.hf.token_to_id("<|im_end|>")
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == im_start and tok.decode(ids[1:]) == "user"
    assert tok.encode("<|im_start|>user\nhi<|im_end|>\n").count(im_end) == 1
    assert {im_end, tok.eos_token_id} <= tok.stop_token_ids
    assert tok.hf.token_to_id("<|endoftext|>") in tok.stop_token_ids
    assert (tok.bos_token, tok.eos_token, tok.bos_token_id, tok.eos_token_id) == ("<|im_start|>", "<|im_end|>", 1, 2)
    assert tok.pad_token_id == 2 and tok.add_bos is False and tok.vocab_size == 49152
    assert set(range(17)) == tok.special_ids
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.id_to_piece(tok.encode(" world", False)[0]) == "Ġworld"
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"


def test_tinycoder_special_tokens() -> None:
    tok, ref = ours("tinycoder"), reference("tinycoder")
    assert (tok.bos_token, tok.eos_token, tok.bos_token_id, tok.eos_token_id) == ("<s>", "</s>", 1, 2)
    assert tok.add_bos is True and tok.encode("hi")[0] == 1 and tok.encode("hi", False)[0] != 1
    assert tok.stop_token_ids == frozenset({2}) and tok.special_ids == frozenset({0, 1, 2})
    assert tok.pad_token_id is None and tok.chat_template is None
    assert tok.id_to_piece(3) == "<0x00>" and tok.id_to_piece(tok.encode("Hello", False)[0]) == "▁Hello"
    assert tok.encode("</s>", False) == [2] and ref.all_special_ids and set(ref.all_special_ids) <= tok.special_ids
    with pytest.raises(IndexError):
        tok.id_to_piece(10**6)


def test_from_gguf_with_gguffile() -> None:
    """The public entry with runlm's own GGUF reader gives the same tokenizer."""
    from runlm.formats.gguf import GGUFFile

    for name in NAMES:
        tok = Tokenizer.from_gguf(GGUFFile(_gguf_path(name)))
        assert tok.hf.to_str() == ours(name).hf.to_str() and tok.stop_token_ids == ours(name).stop_token_ids


def test_gguf_errors_name_the_file() -> None:
    with pytest.raises(ModelFormatError, match="broken.gguf"):
        Tokenizer.from_gguf(SimpleNamespace(metadata={}, path="broken.gguf"))
    md = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(ModelFormatError, match="x.gguf.*'bert'"):
        Tokenizer.from_gguf_metadata(md, "x.gguf")
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a c"]}
    with pytest.raises(ModelFormatError, match="y.gguf"):
        Tokenizer.from_gguf_metadata(md, "y.gguf")
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
          "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": 9}
    with pytest.raises(ModelFormatError, match="z.gguf.*eos_token_id"):
        Tokenizer.from_gguf_metadata(md, "z.gguf")


def test_gguf_pre_tokenizer_regex() -> None:
    """A known tokenizer.ggml.pre swaps GPT-2's split for that model's regex (as transformers does);
    "smollm" is not one of them (llama.cpp splits digits one by one there; SmolLM2's vocab has no
    multi-digit or space+digit tokens, so BPE gives single digits all the same)."""
    md = read_metadata(_gguf_path("smollm2"))
    text = "abc 12345 DON'T\n\n  x"
    split = lambda t: [p for p, _ in t.hf.pre_tokenizer.pre_tokenize_str(text)]  # noqa: E731
    assert split(ours("smollm2")) == ["abc", "Ġ12345", "ĠDON", "'", "T", "ĊĊĠ", "Ġx"]
    assert [ours("smollm2").id_to_piece(i) for i in ours("smollm2").encode(" 12345", False)] == ["Ġ", *"12345"]
    llama3 = Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.pre": "llama-bpe"}, "x.gguf")
    assert split(llama3) == ["abc", "Ġ", "123", "45", "ĠDON", "'T", "ĊĊ", "Ġ", "Ġx"]
    qwen2 = Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.pre": "qwen2"}, "x.gguf")
    assert split(qwen2) == ["abc", "Ġ", "1", "2", "3", "4", "5", "ĠDON", "'T", "ĊĊ", "Ġ", "Ġx"]


# -- from_dir and save_pretrained ----------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_round_trip(name: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = ours(name)
    tok.save_pretrained(tmp_path)
    back, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    facts = lambda t: (t.bos_token_id, t.eos_token_id, t.pad_token_id, t.stop_token_ids,  # noqa: E731
                       t.special_ids, t.add_bos, t.chat_template, t.vocab_size)
    assert facts(back) == facts(tok)
    assert hf.chat_template == tok.chat_template and hf.bos_token == tok.bos_token and hf.eos_token == tok.eos_token
    for add in (True, False):
        bad = [s for s in STRINGS
               if not back.encode(s, add) == tok.encode(s, add) == hf(s, add_special_tokens=add)["input_ids"]]
        assert not bad, _report(bad)
    ids = [i for s in STRINGS[:100] for i in tok.encode(s)]
    assert back.decode(ids) == hf.decode(ids) == tok.decode(ids)


def test_from_dir_reads_transformers_output(tmp_path: Path) -> None:
    """A directory written by transformers (chat_template.jinja), plus generation_config eos ids."""
    reference("smollm2").save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template == reference("smollm2").chat_template
    assert tok.stop_token_ids == ours("smollm2").stop_token_ids | {7}
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1 and not tok.add_bos
    bad = [s for s in STRINGS if tok.encode(s) != ours("smollm2").encode(s)]
    assert not bad, _report(bad)


def test_save_pretrained_replaces_stale_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    reference("smollm2").save_pretrained(tmp_path)  # writes chat_template.jinja
    ours("tinycoder").save_pretrained(tmp_path)
    assert Tokenizer.from_dir(tmp_path).chat_template is None
    assert AutoTokenizer.from_pretrained(str(tmp_path)).chat_template is None
    ours("smollm2").save_pretrained(tmp_path)
    assert Tokenizer.from_dir(tmp_path).chat_template == ours("smollm2").chat_template


def test_from_dir_named_templates_and_special_map(tmp_path: Path) -> None:
    ours("tinycoder").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token"):
        del cfg[key]
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template == "D" and tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.add_bos


def test_from_dir_bert_wordpiece() -> None:
    """An encoder's directory (WordPiece, [CLS] ... [SEP]): its tokenizer.json pads to 128, but
    encode() neither pads nor truncates, as transformers' tok(text)."""
    from transformers import AutoTokenizer

    from tests.fixtures import models

    try:
        path = models.minilm_dir()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    tok, ref = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(str(path))
    assert tok.encode("Hello, world!") == [101, 7592, 1010, 2088, 999, 102]
    assert tok.pad_token_id == 0 and tok.bos_token_id is None and not tok.add_bos
    for add in (True, False):
        bad = [s for s in STRINGS if tok.encode(s, add) != ref(s, add_special_tokens=add)["input_ids"]]
        assert not bad, _report(bad)
    bad = [s for s in STRINGS if tok.decode(tok.encode(s), True) != ref.decode(tok.encode(s), skip_special_tokens=True)]
    assert not bad, _report(bad)


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# -- incremental detokenizer -----------------------------------------------------------------------

def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_matches_decode(pair: tuple[str, Tokenizer, Any], skip: bool) -> None:
    _, tok, _ = pair
    held = 0
    for s in STRINGS:
        ids = tok.encode(s)
        full = tok.decode(ids, skip_special_tokens=skip)
        deltas = _stream(tok, ids, skip=skip)
        assert "".join(deltas) == full, s
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in deltas[:-1]), s
        held += sum(d == "" for d in deltas[:-1])
    assert held > 100  # multi-byte characters really were split across tokens and held back


def test_incremental_holds_partial_characters() -> None:
    tok = ours("tinycoder")
    ids = tok.encode("a😀", add_special_tokens=False)
    assert [tok.id_to_piece(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert _stream(tok, ids) == ["a", "", "", "", "", "😀"]  # an open byte run waits for its end...
    assert _stream(tok, tok.encode("a😀 b", False)) == ["a", "", "", "", "", "😀 b", ""]  # ...or the next token
    smol = ours("smollm2")
    deltas = _stream(smol, smol.encode("🫠🫶🏿"))
    assert "".join(deltas) == "🫠🫶🏿" and "" in deltas[:-1]
    # a truncated character is held to the end, then flushed as decode() has it (one U+FFFD a byte)
    assert _stream(tok, ids[:-1]) == ["a", "", "", "", "\ufffd" * 3] and tok.decode(ids[:-1]) == "a" + "\ufffd" * 3


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_with_prompt_context(pair: tuple[str, Tokenizer, Any], skip: bool) -> None:
    _, tok, _ = pair
    rng, checked = random.Random(3), 0
    for s in STRINGS[::3]:
        ids = tok.encode(s)
        for cut in sorted({0, 1, len(ids) // 2, rng.randrange(len(ids) + 1)}):
            prompt, gen = ids[:cut], ids[cut:]
            before, full = tok.decode(prompt, skip), tok.decode(ids, skip)
            if not full.startswith(before):  # the cut splits a character: no prompt ends like that
                continue
            expected = full[len(before):]
            checked += 1
            assert "".join(_stream(tok, gen, prompt, skip)) == expected, (s, cut)
    assert checked > 400


def test_incremental_sentencepiece_leading_space() -> None:
    tok = ours("tinycoder")
    prompt, gen = tok.encode("Hello"), tok.encode(" world again", add_special_tokens=False)
    assert tok.id_to_piece(gen[0]) == "▁world"
    assert _stream(tok, gen, prompt)[0] == " world"
    assert _stream(tok, gen)[0] == "world"  # without context, decode() drops the prefix space too
    assert "".join(_stream(tok, gen, [tok.bos_token_id])) == "world again"


def test_incremental_special_tokens_mid_stream() -> None:
    for name, text in (("smollm2", "Hi<|im_end|> there<|im_start|>x"), ("tinycoder", "Hi</s> there<s> x")):
        tok = ours(name)
        ids = tok.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert "".join(_stream(tok, ids, skip=skip)) == tok.decode(ids, skip), (name, skip)


@pytest.mark.parametrize("name", NAMES)
def test_incremental_on_invalid_utf8(name: str) -> None:
    """Random ids, mostly single-byte tokens: invalid UTF-8, lone special tokens. The stream still
    equals decode() while byte runs stay shorter than BYTE_RUN_HOLD."""
    tok, rng = ours(name), random.Random(11)
    if tok.byte_token_ids:
        singles = sorted(tok.byte_token_ids)
    else:
        singles = [i for i in range(tok.vocab_size) if len(tok.id_to_piece(i)) == 1]
    for _ in range(400):
        ids: list[int] = []
        while len(ids) < 30:
            ids += [rng.choice(singles) for _ in range(rng.randint(0, IncrementalDetokenizer.BYTE_RUN_HOLD - 2))]
            ids.append(rng.randrange(tok.vocab_size))
        cut = rng.randrange(len(ids))
        for skip in (True, False):
            before, full = tok.decode(ids[:cut], skip), tok.decode(ids, skip)
            assert "".join(_stream(tok, ids, skip=skip)) == full
            if full.startswith(before) and "\ufffd" not in before:
                assert "".join(_stream(tok, ids[cut:], ids[:cut], skip)) == full[len(before):]


class _Spy:
    """Records the longest id list the detokenizer decodes at once."""

    def __init__(self, tok: Tokenizer) -> None:
        self.special_ids, self.byte_token_ids, self.real, self.longest = tok.special_ids, tok.byte_token_ids, tok.hf, 0
        self.hf = self

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.longest = max(self.longest, len(ids))
        return self.real.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("name", NAMES)
def test_incremental_window_is_bounded(name: str) -> None:
    tok = ours(name)
    ids = tok.encode(" ".join(STRINGS))
    assert len(ids) > 5000
    spy = _Spy(tok)
    detok = IncrementalDetokenizer(spy, prompt_ids=ids[:1000])  # type: ignore[arg-type]
    out = "".join(detok.push(i) for i in ids[1000:]) + detok.flush()
    assert out == tok.decode(ids, True)[len(tok.decode(ids[:1000], True)):]
    assert spy.longest <= 2 * (IncrementalDetokenizer.MAX_PENDING + 1)  # independent of the length

"""Tokenizers: a fast `tokenizers.Tokenizer` built from GGUF metadata or an HF directory.

The GGUF conversion follows transformers' own (``transformers.integrations.gguf``), which is the
reference the tests hold it to, so ids match ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``.
Where that differs from llama.cpp, transformers wins: ``tokenizer.ggml.add_space_prefix`` is not
honoured, and pre-tokenizer names it does not know (``smollm``, ``default``...) get the plain GPT-2
byte-level split (llama.cpp splits digits one by one for ``smollm``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from runlm.formats import ModelFormatError
from runlm.formats.fim import FimTokens, NoFim, find_fim_tokens, gguf_fim_ids
from runlm.formats.modelfile import ChatDefaults

_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GGUF_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
             "pad_token": "padding_token_id"}
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<end_of_turn>", "<|end|>",
               "<|end_of_text|>", "<|return|>", "<|end_of_turn|>")

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> split regex, as in transformers; anything else keeps GPT-2's ByteLevel regex.
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35, "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def generate_merges(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary, best score first (transformers' algorithm)."""
    merges = []
    for merge, score in scores.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece(tokens: Sequence[str], scores: Sequence[float] | None, merges: list[tuple[str, str]] | None,
                   arch: str | None, unk: int | None, path: Any) -> HFTokenizer:
    """A SentencePiece ("llama") vocabulary as transformers builds it from a GGUF, by architecture: Llama's
    (Metaspace, a prefix space on the first word); Gemma's (no prefix space, spaces spelled "\u2581" by a
    normalizer, runs of spaces stored as spaces respelled, merges in file order); Phi-3's (a prefix space
    from a normalizer)."""
    gemma = arch in ("gemma", "gemma2", "gemma3")
    if gemma:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges is None:
        order = {t: -i for i, t in enumerate(tokens)} if gemma else dict(zip(tokens, scores or []))
        merges = generate_merges(vocab, order)
    _check_merges(vocab, merges, path)
    unk_token = tokens[int(unk)] if gemma and unk is not None else None
    hf = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None,
                         unk_token=unk_token))
    if gemma:
        hf.normalizer = normalizers.Replace(" ", "\u2581")
        hf.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        return hf
    if arch == "phi3":
        hf.normalizer = normalizers.Sequence([normalizers.Prepend(prepend="\u2581"),
                                              normalizers.Replace(pattern=" ", content="\u2581")])
    else:
        hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return hf


def _template(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None,
              add_bos: bool, add_eos: bool) -> processors.TemplateProcessing:
    """The post-processor transformers builds for add_bos_token / add_eos_token."""
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = (f"{bos}:0 " if add_bos else "") + "$A:0" + (f" {eos}:0" if add_eos else "")
    pair = single + (f" {bos}:1" if add_bos else "") + " $B:1" + (f" {eos}:1" if add_eos else "")
    special = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _check_merges(vocab: Mapping[str, int], merges: Sequence[tuple[str, str]], path: Any) -> None:
    """tokenizers panics (not raises) on some bad merges, so check them first."""
    for a, b in merges:
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise ModelFormatError(f"{path}: merge {a!r} + {b!r} uses a token missing from the vocabulary")


MAX_JSON_FILE = 64 << 20        # tokenizer_config.json, config.json and the like: real ones are far smaller
MAX_TOKENIZER_FILE = 512 << 20  # tokenizer.json (the largest real ones are tens of MB)
MAX_TEMPLATE_FILE = 4 << 20     # chat_template.jinja


def _check_size(path: Path, limit: int) -> None:
    size = path.stat().st_size
    if size > limit:
        raise ModelFormatError(f"{path}: {size} bytes, more than the {limit} runlm reads from such a file")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        _check_size(path, MAX_JSON_FILE)
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path}: cannot read JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


class Tokenizer:
    """A fast tokenizer (the `tokenizers` library) plus the special-token facts runlm needs."""

    def __init__(self, hf: HFTokenizer, named: Mapping[str, str | None], chat_template: str | None = None,
                 extra_special: Iterable[str] = (), extra_stop_ids: Iterable[int] = (),
                 clean_up_spaces: bool = False, fim_ids: Mapping[str, int] | None = None) -> None:
        # Like transformers' _post_init: named and extra special tokens always match whole, as special.
        added = hf.get_added_tokens_decoder()
        for tok in [*(t for t in named.values() if t), *extra_special]:
            i = hf.token_to_id(tok)
            if i is None or i not in added or not added[i].special or added[i].content != tok:
                hf.add_special_tokens([AddedToken(tok, special=True, normalized=False)])
        self.hf = hf
        self.named = {k: v for k, v in named.items() if v}
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token = self.named.get("bos_token"), self.named.get("eos_token")
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        self.pad_token_id = self._id(self.named.get("pad_token"))
        extra_stop_ids = [i for i in extra_stop_ids if 0 <= i < self.vocab_size]
        if self.eos_token_id is None and extra_stop_ids:
            self.eos_token_id, self.eos_token = extra_stop_ids[0], hf.id_to_token(extra_stop_ids[0])
        self.chat_template = chat_template
        # a Modelfile's SYSTEM and MESSAGE lines, put around every conversation (runlm.formats.modelfile)
        self.chat_defaults: ChatDefaults | None = None
        self.special_ids: frozenset[int] = frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special)
        eot = self.special_ids & {self._id(t) for t in END_OF_TURN}
        self.stop_token_ids: frozenset[int] = frozenset(
            {i for i in (self.eos_token_id, *extra_stop_ids) if i is not None} | eot)
        empty = hf.encode("", add_special_tokens=True).ids
        self.add_bos: bool = self.bos_token_id is not None and empty[:1] == [self.bos_token_id]
        self._clean_up = clean_up_spaces and type(hf.model).__name__ != "BPE"
        # SentencePiece byte-fallback pieces <0x00>..<0xFF> (empty for byte-level vocabularies)
        byte_ids = [hf.token_to_id(f"<0x{b:02X}>") for b in range(256)] if getattr(hf.model, "byte_fallback", 0) else []
        self.byte_token_ids: frozenset[int] = frozenset(i for i in byte_ids if i is not None)
        self._fim_ids = dict(fim_ids or {})
        self._fim: FimTokens | NoFim | None = None
        self._plain: HFTokenizer | None = None  # a copy that reads special tokens' spellings as text

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.hf.token_to_id(token)

    # -- loading ----------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gguf_file: Any) -> Tokenizer:
        """From a GGUFFile-like object (``.metadata`` and ``.path``)."""
        return cls.from_gguf_metadata(gguf_file.metadata, gguf_file.path)

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any], path: str | os.PathLike = "<gguf>") -> Tokenizer:
        """From the GGUF key/value metadata, the way transformers converts it."""
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise ModelFormatError(f"{path}: no tokenizer in the metadata (tokenizer.ggml.tokens is missing)")
        kind, arch = md.get("tokenizer.ggml.model"), md.get("general.architecture")
        types, scores = md.get("tokenizer.ggml.token_type"), md.get("tokenizer.ggml.scores")
        types = [1] * len(tokens) if types is None else [int(t) for t in types]
        merges_raw = md.get("tokenizer.ggml.merges")
        if len(types) != len(tokens) or (scores is not None and len(scores) != len(tokens)):
            raise ModelFormatError(f"{path}: tokenizer.ggml.token_type/scores do not match the {len(tokens)} tokens")
        merges: list[tuple[str, str]] | None = None
        if merges_raw is not None:
            try:
                merges = [(a, b) for a, b in (m.split(" ") for m in merges_raw)]
            except ValueError:  # not two tokens
                raise ModelFormatError(f"{path}: malformed entry in tokenizer.ggml.merges") from None
        if kind not in ("gpt2", "llama"):
            raise ModelFormatError(f"{path}: tokenizer {kind!r} (architecture {arch!r}) is not supported; "
                                   f"runlm reads 'gpt2' byte-level BPE and 'llama' SentencePiece vocabularies")
        if kind == "llama" and merges is None and scores is None:
            raise ModelFormatError(f"{path}: SentencePiece vocabulary without scores or merges")
        spelled = None
        try:
            if kind == "gpt2":
                table = bytes_to_unicode()
                spelled = set(table.values())
                vocab = {t if set(t) <= spelled else "".join(table[b] for b in t.encode("utf-8")): i
                         for i, t in enumerate(tokens)}
                _check_merges(vocab, merges or [], path)
                hf = HFTokenizer(BPE(vocab=vocab, merges=merges or [], dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
                hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
                hf.decoder = decoders.ByteLevel()
            else:
                hf = _sentencepiece(tokens, scores, merges, arch, md.get("tokenizer.ggml.unknown_token_id"), path)
        except ModelFormatError:
            raise
        except Exception as exc:  # tokenizers raises plain Exceptions on a bad vocabulary/merges
            raise ModelFormatError(f"{path}: cannot build the tokenizer: {exc}") from None
        control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                   if k == 3 and (spelled is None or set(t) <= spelled)]
        hf.add_special_tokens(control)
        vocab_now = hf.get_vocab()
        hf.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
                       if k == 4 and t in vocab_now])
        split = PRE_TOKENIZER_SPLITS.get(md.get("tokenizer.ggml.pre", ""))
        if split is not None:
            hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                        pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=False)])
        named: dict[str, str | None] = {}
        for name, key in _GGUF_IDS.items():
            i = md.get(f"tokenizer.ggml.{key}")
            if i is not None and not 0 <= int(i) < len(tokens):
                raise ModelFormatError(f"{path}: tokenizer.ggml.{key} {i} is outside the vocabulary")
            named[name] = tokens[int(i)] if i is not None else None
        add_bos = md.get("tokenizer.ggml.add_bos_token")
        add_bos = bool(add_bos) if add_bos is not None else kind == "llama"
        bos, eos = named["bos_token"], named["eos_token"]
        hf.post_processor = _template(bos, None if bos is None else hf.token_to_id(bos), eos,
                                      None if eos is None else hf.token_to_id(eos),
                                      add_bos, bool(md.get("tokenizer.ggml.add_eos_token", False)))
        stops = [int(md[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in md]
        template = md.get("tokenizer.chat_template")
        return cls(hf, named, template if isinstance(template, str) else None, extra_stop_ids=stops,
                   fim_ids=gguf_fim_ids(md, len(tokens)))

    @classmethod
    def from_dir(cls, path: str | os.PathLike, config: Mapping[str, Any] | None = None) -> Tokenizer:
        """From an HF model directory: tokenizer.json is authoritative (as in transformers v5, which
        ignores tokenizer_config's add_bos_token when tokenizer.json exists). ``config``: its config.json, where
        the caller has read it already."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelFormatError(f"{path}: no tokenizer.json (runlm needs a fast tokenizer)")
        try:
            _check_size(file, MAX_TOKENIZER_FILE)
            hf = HFTokenizer.from_file(str(file))
        except Exception as exc:
            raise ModelFormatError(f"{file}: cannot read the tokenizer: {exc}") from None
        hf.no_padding()  # encode() is one text, whole: as transformers' tok(text)
        hf.no_truncation()
        cfg = _read_json(path / "tokenizer_config.json")
        smap = _read_json(path / "special_tokens_map.json")
        named = {k: _token_str(cfg.get(k)) or _token_str(smap.get(k)) for k in _NAMED}
        extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
        extra = [t for t in map(_token_str, extra if isinstance(extra, list) else []) if t]
        template = cfg.get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if isinstance(t, dict)
                             and t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():  # transformers: the file wins over the config entry
            _check_size(path / "chat_template.jinja", MAX_TEMPLATE_FILE)
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        stops = [*_id_list(_read_json(path / "generation_config.json").get("eos_token_id")),
                 *_id_list((_read_json(path / "config.json") if config is None else config).get("eos_token_id"))]
        return cls(hf, named, template if isinstance(template, str) else None, extra, stops,
                   bool(cfg.get("clean_up_tokenization_spaces", False)))

    # -- use ----------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; special tokens written in the text match whole."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids for ``text`` as plain text: no BOS, and a special token's spelling in it is text, not the
        token (llama.cpp's tokenize with parse_special false)."""
        if self._plain is None:
            plain = HFTokenizer.from_str(self.hf.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    @property
    def fim(self) -> FimTokens:
        """The model's fill-in-the-middle tokens; NoFim (a ValueError naming what is missing) where it has none."""
        if self._fim is None:  # looked up once (the vocabulary is large), the answer kept
            try:
                self._fim = find_fim_tokens(self.hf.get_vocab(with_added_tokens=True), self._fim_ids)
            except NoFim as exc:
                self._fim = exc
        if isinstance(self._fim, NoFim):
            raise NoFim(str(self._fim))
        return self._fim

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for ``ids`` (as transformers' ``decode``)."""
        text = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def id_to_piece(self, i: int) -> str:
        """The raw vocabulary piece of id ``i`` (byte-level spelling for GPT-2 style vocabularies)."""
        piece = self.hf.id_to_token(i)
        if piece is None:
            raise IndexError(f"token id {i} is outside the vocabulary of {self.vocab_size}")
        return piece

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json, tokenizer_config.json (and special_tokens_map.json) that
        transformers' AutoTokenizer loads with identical behaviour."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(path / "tokenizer.json"))
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **self.named,
                               "add_bos_token": self.add_bos, "clean_up_tokenization_spaces": self._clean_up,
                               "model_max_length": 1 << 60}
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        for name, data in (("tokenizer_config.json", cfg), ("special_tokens_map.json", self.named)):
            (path / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        jinja = path / "chat_template.jinja"  # a stale one would shadow the config entry
        if jinja.is_file() and self.chat_template is not None:
            jinja.write_text(self.chat_template, encoding="utf-8")
        elif jinja.is_file():
            jinja.unlink()


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    vLLM-style prefix/read offsets over a short window of recent tokens: decode the window, and emit
    what lies past the already-emitted part unless it ends in U+FFFD (a character still incomplete).
    Skipped special tokens are dropped up front, which is exactly what ``decode`` does with them.
    SentencePiece's ByteFallback decodes a run of byte tokens as a whole and turns every byte of it
    into U+FFFD if any is invalid, so text ending in an open byte run is held back too (for at most
    BYTE_RUN_HOLD tokens). Exact for any valid UTF-8 output; with invalid bytes from the model, only
    where U+FFFD land can differ (after MAX_PENDING held tokens the text is emitted as it stands).
    """

    CONTEXT = 4          # prompt tokens kept as context for the first generated token
    BYTE_RUN_HOLD = 8    # tokens an open byte-fallback run may be held back
    MAX_PENDING = 16     # then emit anyway: no valid character takes this many tokens

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer.byte_token_ids
        prompt = [i for i in (prompt_ids or ()) if i not in self._skip]
        start = max(len(prompt) - self.CONTEXT, 0)
        # Start on a character boundary: a window opening on a continuation byte decodes as U+FFFD.
        while start > max(len(prompt) - 2 * self.CONTEXT, 0) and self._decode(prompt[start:]).startswith("\ufffd"):
            start -= 1
        self._ids: list[int] = prompt[start:]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.hf.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _emit(self, force: bool) -> str:
        new = self._decode(self._ids)
        pending = len(self._ids) - self._read
        if not force and pending <= self.MAX_PENDING:
            if len(new) <= len(self._prefix_text) or new.endswith("\ufffd"):
                return ""
            if self._ids[-1] in self._byte_ids and pending <= self.BYTE_RUN_HOLD:
                return ""
        delta = new[len(self._prefix_text):]
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.text += delta
        return delta

    def push(self, token_id: int) -> str:
        """The new text made available by ``token_id`` ("" while held back)."""
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        return self._emit(force=False)

    def flush(self) -> str:
        """Whatever is left at the end."""
        return self._emit(force=True) if len(self._ids) > self._read else ""

"""Fill-in-the-middle prompts from a model's own FIM tokens (code completion in editors).

The tokens: a GGUF file's ``tokenizer.ggml.fim_*_token_id`` where it names them, else the vocabulary's
spellings llama.cpp looks for (Qwen2.5-Coder's ``<|fim_prefix|>``, StarCoder2's and Granite's
``<fim_prefix>``, CodeLlama's ``▁<PRE>``, DeepSeek-Coder's ``<｜fim▁begin｜>``, GLM-4.5's ``<|code_prefix|>``...),
the same lists for an HF directory's tokenizer. Prefix, suffix and middle are needed; the repository and file
separators (for other files given as context) where the vocabulary has them.

Two prompt shapes: ``suffix_prompt`` (OpenAI completions' and Ollama's ``suffix``: prefix, suffix, middle, as
Ollama's templates for coder models write it) and ``infill_prompt`` (llama-server's ``/infill``, token for token:
its repository-level pattern, its truncation of the prefix, suffix and extra context). The texts are tokenized
without parsing special tokens, so a file that contains ``<|fim_middle|>`` cannot end the prefix early.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


class Tokenizer(Protocol):
    """What a prompt needs of runlm.formats.tokenizer.Tokenizer."""
    add_bos: bool
    bos_token_id: int | None

    def encode_text(self, text: str) -> list[int]: ...

# role -> the vocabulary's spellings, llama.cpp's (llama-vocab.cpp) and no more: the same model gets the same
# prompt from runlm as from llama-server
SPELLINGS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
GGUF_KEYS = {role: f"tokenizer.ggml.fim_{role}_token_id" for role in SPELLINGS}
NEEDED = ("pre", "suf", "mid")
NAMES = {"pre": "prefix", "suf": "suffix", "mid": "middle"}
# llama-server's defaults that shape its /infill prompt
LLAMA_SERVER_N_BATCH = 2048
_REPO = "myproject\n"
_FILE = "filename\n"
_CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"  # where the vocabulary has no file separator


class NoFim(ValueError):
    """The model has no fill-in-the-middle tokens; the message names the missing ones."""


@dataclass(frozen=True, slots=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int | None = None
    sep: int | None = None


def gguf_fim_ids(metadata: Mapping[str, object], vocab_size: int) -> dict[str, int]:
    """The FIM token ids a GGUF file's metadata names (those inside the vocabulary)."""
    out = {}
    for role, key in GGUF_KEYS.items():
        value = metadata.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size:
            out[role] = value
    return out


def find_fim_tokens(vocab: Mapping[str, int], named: Mapping[str, int]) -> FimTokens:
    """The FIM tokens: ``named`` (a GGUF file's ids) first, then the vocabulary's spellings. NoFim names what is
    missing."""
    ids: dict[str, int | None] = {}
    for role, spellings in SPELLINGS.items():
        ids[role] = named.get(role, next((vocab[s] for s in spellings if s in vocab), None))
    missing = [NAMES[r] for r in NEEDED if ids[r] is None]
    if missing:
        raise NoFim(f"this model has no fill-in-the-middle tokens (no {', '.join(missing)} token): it cannot "
                    f"complete between a prefix and a suffix; use a coder model with FIM tokens (Qwen2.5-Coder, "
                    f"StarCoder2, CodeLlama...)")
    return FimTokens(**ids)  # type: ignore[arg-type]


def suffix_prompt(tok: Tokenizer, fim: FimTokens, prefix: str, suffix: str) -> list[int]:
    """[BOS] PRE prefix SUF suffix MID: the middle is what the model writes next."""
    bos = [tok.bos_token_id] if tok.add_bos and tok.bos_token_id is not None else []
    return [*bos, fim.pre, *tok.encode_text(prefix), fim.suf, *tok.encode_text(suffix), fim.mid]


@dataclass(frozen=True, slots=True)
class ExtraChunk:
    text: str
    filename: str = "tmp"


def infill_prompt(tok: Tokenizer, fim: FimTokens, prefix: str, suffix: str, extra: Sequence[ExtraChunk] = (),
                  prompt: str = "", n_ctx: int = 4096, n_predict: int = -1,
                  n_batch: int = LLAMA_SERVER_N_BATCH) -> list[int]:
    """llama-server's /infill prompt (its format_prompt_infill, prefix-suffix-middle order):
    [REP myproject\\n] {SEP filename\\n text}... [SEP filename\\n] [BOS] PRE prefix prompt SUF suffix MID, with the
    prefix's last 3/4 of a batch, the suffix's first quarter less the prompt, and the extra context's last
    n_ctx - n_batch - 2 n_predict tokens."""
    extra_ids: list[int] = []
    if fim.rep is not None:
        extra_ids += [fim.rep, *tok.encode_text(_REPO)]
    for chunk in extra:
        if fim.sep is not None:
            extra_ids += [fim.sep, *tok.encode_text(chunk.filename + "\n")]
        else:
            extra_ids += tok.encode_text(_CHUNK_SEPARATOR)
        extra_ids += tok.encode_text(chunk.text)
    if fim.sep is not None:
        extra_ids += [fim.sep, *tok.encode_text(_FILE)]
    prompt_ids = tok.encode_text(prompt) if prompt else []
    prefix_ids, suffix_ids = tok.encode_text(prefix), tok.encode_text(suffix)
    n_prefix = min(len(prefix_ids), 3 * (n_batch // 4))
    n_suffix = min(len(suffix_ids), max(0, n_batch // 4 - (2 + len(prompt_ids))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_ids))
    head = [fim.pre, *prefix_ids[len(prefix_ids) - n_prefix:], *prompt_ids]
    if tok.add_bos and tok.bos_token_id is not None:
        head.insert(0, tok.bos_token_id)
    return [*extra_ids[len(extra_ids) - n_extra:], *head, fim.suf, *suffix_ids[:n_suffix], fim.mid]

"""Fill-in-the-middle prompts: the model's FIM tokens found as llama.cpp finds them, llama-server's /infill
prompt token for token (against llama.cpp's own tokenizer and FIM ids, where llama-cpp-python is installed)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from runlm.formats.fim import ExtraChunk, FimTokens, NoFim, find_fim_tokens, infill_prompt, suffix_prompt
from runlm.formats.gguf import GGUFFile
from runlm.formats.tokenizer import Tokenizer
from tests.fixtures.models import fim_gguf, smollm2_gguf, tinycoder_gguf


def _tok(style: str) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(str(fim_gguf(style))))


def test_fim_tokens_by_spelling_and_gguf_ids_first() -> None:
    vocab = {"<|fim_prefix|>": 10, "<|fim_suffix|>": 11, "<|fim_middle|>": 12, "<|repo_name|>": 13,
             "<|file_sep|>": 14, "▁<PRE>": 20}
    assert find_fim_tokens(vocab, {}) == FimTokens(10, 11, 12, 13, 14)
    assert find_fim_tokens(vocab, {"pre": 20}).pre == 20
    codellama = {"▁<PRE>": 1, "▁<SUF>": 2, "▁<MID>": 3, "▁<EOT>": 4}
    assert find_fim_tokens(codellama, {}) == FimTokens(1, 2, 3, None, None)
    with pytest.raises(NoFim, match="no suffix, middle token"):
        find_fim_tokens({"<|fim_prefix|>": 1}, {})


def test_models_without_fim_tokens_say_so() -> None:
    for path in (smollm2_gguf(), tinycoder_gguf()):
        with pytest.raises(NoFim, match="fill-in-the-middle"):
            _ = Tokenizer.from_gguf(GGUFFile(str(path))).fim


def test_texts_are_tokenized_without_special_tokens() -> None:
    tok = _tok("qwen")
    assert tok.encode("a<|fim_middle|>b") == [81, tok.fim.mid, 82]  # a template's text: the token
    plain = tok.encode_text("a<|fim_middle|>b")
    assert tok.fim.mid not in plain and tok.decode(plain) == "a<|fim_middle|>b"  # a file's text: text


def test_suffix_prompt_is_prefix_suffix_middle() -> None:
    tok = _tok("starcoder")
    fim = tok.fim
    ids = suffix_prompt(tok, fim, "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n")
    assert ids[0] == fim.pre and ids[-1] == fim.mid and ids.count(fim.suf) == 1
    assert tok.decode(ids) == "<fim_prefix>def add(a, b):\n    <fim_suffix>\n\nprint(add(1, 2))\n<fim_middle>"


def test_infill_prompt_has_llama_servers_repository_layout_and_budgets() -> None:
    tok = _tok("qwen")
    extra = [ExtraChunk("x = 1\n", "a.py"), ExtraChunk("y = 2\n", "b.py")]
    ids = infill_prompt(tok, tok.fim, "def f():\n", "\nreturn 1\n", extra, "    ", n_ctx=4096)
    assert tok.decode(ids) == ("<|repo_name|>myproject\n<|file_sep|>a.py\nx = 1\n<|file_sep|>b.py\ny = 2\n"
                               "<|file_sep|>filename\n<|fim_prefix|>def f():\n    <|fim_suffix|>\nreturn 1\n"
                               "<|fim_middle|>")
    # the prefix keeps its last 3/4 of a batch, the suffix its first quarter less the prompt and two tokens,
    # the other files the last n_ctx - n_batch - 2 * n_predict tokens (n_predict -1: llama-server's default)
    long = "a " * 3000
    ids = infill_prompt(tok, tok.fim, long, long, extra, "", n_ctx=2048)
    pre, suf, mid = ids.index(tok.fim.pre), ids.index(tok.fim.suf), ids.index(tok.fim.mid)
    assert pre == 2 and suf - pre - 1 == 1536 and mid - suf - 1 == 512 - 2 and mid == len(ids) - 1
    starcoder = _tok("starcoder")
    ids = infill_prompt(starcoder, starcoder.fim, "p", "s", extra[:1], n_ctx=8192)
    assert starcoder.decode(ids) == ("<reponame>myproject\n\n\n--- snippet ---\n\nx = 1\n"  # no file separator
                                     "<fim_prefix>p<fim_suffix>s<fim_middle>")


@pytest.mark.parametrize("style", ["qwen", "starcoder"])
def test_infill_prompt_equals_llama_servers_with_llama_cpps_own_vocabulary(style: str) -> None:
    """llama-server's format_prompt_infill, step for step, on llama.cpp's tokenizer and FIM ids (read in a child
    process: llama.cpp's libllama must not meet the libggml this process may have loaded)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python (the bench extra) is not installed")
    prefix, suffix, prompt = "import os\n<|fim_middle|>def main():\n" * 40, "\n    return 0\n" * 90, "  "
    extra = [ExtraChunk("CONST = 3\n" * 30, "const.py"), ExtraChunk("def g(): pass\n")]
    texts = [prefix, suffix, prompt, "myproject\n", "\n\n--- snippet ---\n\n", "filename\n",
             *(c.filename + "\n" for c in extra), *(c.text for c in extra)]
    code = ("import json, sys, llama_cpp\n"
            "llm = llama_cpp.Llama(sys.argv[1], vocab_only=True, verbose=False)\n"
            "vocab = llama_cpp.llama_model_get_vocab(llm.model)\n"
            "fim = [getattr(llama_cpp, 'llama_vocab_fim_' + r)(vocab) for r in ('pre', 'suf', 'mid', 'rep', 'sep')]\n"
            "texts = json.loads(sys.stdin.read())\n"
            "print(json.dumps([fim, [llm.tokenize(t.encode(), add_bos=False, special=False) if t else [] "
            "for t in texts]]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(fim_gguf(style))], input=json.dumps(texts),
                         capture_output=True, text=True, check=True)
    (pre, suf, mid, rep, sep), ids = json.loads(out.stdout.strip().splitlines()[-1])
    tokenized = dict(zip(texts, ids))

    def tokenize(text: str) -> list[int]:
        return tokenized[text]

    n_ctx, n_batch, n_predict = 2400, 2048, -1
    extra_ids = [rep, *tokenize("myproject\n")] if rep != -1 else []
    for chunk in extra:
        extra_ids += [sep, *tokenize(chunk.filename + "\n")] if sep != -1 else tokenize("\n\n--- snippet ---\n\n")
        extra_ids += tokenize(chunk.text)
    if sep != -1:
        extra_ids += [sep, *tokenize("filename\n")]
    p_ids, s_ids, prompt_ids = tokenize(prefix), tokenize(suffix), tokenize(prompt)
    n_pre = min(len(p_ids), 3 * (n_batch // 4))
    n_suf = min(len(s_ids), max(0, n_batch // 4 - (2 + len(prompt_ids))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_ids))
    want = [*extra_ids[len(extra_ids) - n_extra:], pre, *p_ids[len(p_ids) - n_pre:], *prompt_ids, suf,
            *s_ids[:n_suf], mid]
    tok = _tok(style)
    assert infill_prompt(tok, tok.fim, prefix, suffix, extra, prompt, n_ctx=n_ctx, n_predict=n_predict) == want

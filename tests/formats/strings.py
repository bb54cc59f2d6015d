"""A deterministic corpus of varied strings for tokenizer tests (``STRINGS``, at least 500).

Hand-written samples (many scripts, emoji, combining marks, code, whitespace, special tokens
embedded in text...) plus seeded random mixtures of them and of characters drawn from many Unicode
blocks. Generated, never read from disk; the same list on every run.
"""
from __future__ import annotations

import random

SCRIPTS = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé façade, naïve café, Straße, Œuvre, Ångström",
    "你好，世界！今天天气很好。", "机器学习是人工智能的一个分支。", "繁體中文：臺灣、電腦、學習",
    "こんにちは世界。カタカナとひらがな、漢字。", "ｶﾀｶﾅ ﾊﾝｶｸ", "東京都渋谷区",
    "안녕하세요 세계! 한국어 문장입니다.", "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Γειά σου Κόσμε! Ελληνικά γράμματα: αβγδεζηθ", "مرحبا بالعالم! هذا نص عربي.", "שלום עולם! טקסט בעברית",
    "नमस्ते दुनिया! यह हिंदी है।", "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่าง", "გამარჯობა მსოფლიო", "Բարեւ աշխարհ",
    "வணக்கம் உலகம்", "ওহে বিশ্ব", "ሰላም ልዑል", "Xin chào thế giới! Tiếng Việt có dấu.", "Merhaba dünya, İstanbul ılık",
    "Cześć świecie! Zażółć gęślą jaźń", "Ahoj světe, příliš žluťoučký kůň", "ᚠᛇᚻ᛫ᛒᛦᚦ runes", "ꦲꦏ꧀ꦱꦫ Javanese",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝒮𝒸𝓇𝒾𝓅𝓉", "∀x∈ℝ: x² ≥ 0 ⇒ √(x²) = |x|", "∑_{i=1}^{n} i = n(n+1)/2, ∫₀¹ x dx = ½",
    "Ⅻ ⅷ ① ② ③ ⑴ ⒜", "€100, £50, ¥1000, ₹500, ₿0.001, ¢", "©®™℠ § ¶ † ‡ • … ‰ ′ ″",
]
EMOJI = [
    "😀😃😄😁", "I ❤️ NY", "👍🏻👍🏼👍🏽👍🏾👍🏿", "👨‍👩‍👧‍👦 family", "👩🏽‍💻 coding", "🏳️‍🌈 🏴‍☠️",
    "🇺🇸🇯🇵🇫🇷🇩🇪", "1️⃣2️⃣#️⃣", "🧑‍🤝‍🧑", "🤷‍♀️🤦🏻‍♂️", "🐍 + 🦀 = ❤", "emoji at end 🎉", "🎉 emoji at start",
    "mixed 中文 and emoji 🚀 and العربية", "☕️☃︎", "🫠🫶🏿🪿", "👁️‍🗨️",
]
COMBINING = [
    "e\u0301 vs \u00e9", "n\u0303o", "Zalgo: Z\u0351\u036b\u0343\u036a\u0302a\u0310\u0363l\u0300g\u0358o",
    "a\u0308\u0304", "\u0915\u094d\u0937", "Å vs A\u030a", "ﬁ ﬂ ﬀ ligatures", "\u1100\u1161\u11a8 jamo",
    "dotless ı and dotted İ", "\u0301leading combining mark", "ǅǈǋ titlecase digraphs",
]
CODE = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import numpy as np\nx = np.arange(10)**2  # squares\nprint(f\"{x.sum():,}\")",
    "class Foo(Bar):\n\tdef __init__(self, *args, **kwargs) -> None:\n\t\tsuper().__init__(*args, **kwargs)",
    "function add(a, b) {\n  return a + b;\n}\nconsole.log(add(1, 2)); // 3",
    "const x = [1, 2, 3].map((v) => v * 2).filter(Boolean);",
    "fn main() {\n    let v: Vec<u8> = vec![0xDE, 0xAD];\n    println!(\"{:?}\", v);\n}",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    "<html><body><p class=\"x\">Hi &amp; bye</p></body></html>",
    "{\"key\": [1, 2.5, null, true], \"n\": {\"a\": \"b\"}}",
    "#!/bin/bash\nfor f in *.txt; do echo \"$f\" | tr a-z A-Z; done", "git commit -m 'fix: off-by-one' && git push",
    "regex: ^(?:[a-z0-9!#$%&'*+/=?^_`{|}~-]+)@\\w+\\.[a-z]{2,}$", "x += 1; y -= 2; z *= 3; w /= 4; q **= 5",
    "if (a && b || !c) { return a != b ? a : b; }",
    "package main\n\nimport \"fmt\"\n\nfunc main() { fmt.Println(\"hi\") }",
    "   indented with spaces\n\tindented with tab\n", "a\\nb\\tc\\\\d", "lambda x: x if x else None",
    "<?php echo $var; ?>", "@decorator\nasync def f(): await g()", "val xs = List(1,2,3).foldLeft(0)(_ + _)",
    "// TODO(alice): 修复这个 bug", "    ", "\t\t\t", "{{ template }} {% if x %}y{% endif %}",
]
WHITESPACE = [
    "", " ", "  ", "   ", "\n", "\n\n", "\n\n\n", "\t", "\r\n", "\r", " \n ", "\t \t", "\r\n\r\n",
    " leading space", "  two leading spaces", "trailing space ", "trailing spaces   ", " both ",
    "tabs\tin\tthe\tmiddle", "line1\nline2\nline3", "windows\r\nline\r\nendings", "mixed \t\n\r\n whitespace",
    "multiple     spaces     between", "\u00a0nbsp\u00a0here", "ideographic\u3000space", "zero\u200bwidth\u200bspace",
    "\ufeffBOM at start", "line\u2028separator\u2029para", "em\u2003space\u2009thin", "\x00nul\x07bell\x1besc",
    "\x7fdel\x0bvt\x0cff", "ends with newline\n", "\nstarts with newline", " \n", "\n ", "a\n\n\n\nb",
]
NUMBERS = [
    "0", "7", "42", "123", "1234", "12345", "1234567890", "3.14159", "-2.5e-10", "1,000,000", "1 000 000",
    "0xDEADBEEF", "0b1010", "1e100", "2024-01-31T12:34:56Z", "+1 (555) 123-4567", "v1.2.3-beta+exp.sha.5114f85",
    "١٢٣٤٥ ٦٧٨٩٠", "१२३४", "一二三 四五六", "３２１ full-width digits", "99.9% of 100%", "$19.99", "10^9 × 10³",
]
PUNCT = [
    "Hello!!!", "What?!", "Wait...", "«Bonjour» „Hallo“ “quotes” ‘single’", "—em—dash–en-dash-hyphen",
    "(parens) [brackets] {braces} <angles>", "a/b\\c|d", "~!@#$%^&*()_+`-=[]\\{}|;':\",./<>?",
    "don't can't won't I'm you're he's we've they'll I'd", "DON'T CAN'T I'M", "o'clock rock'n'roll",
    "¿Qué? ¡Sí!", "。、！？「」『』【】", "，；：“”（）", "...", "---", "___", "***bold***", "#hashtag @mention",
]
URLS = [
    "https://example.com/path?query=1&b=two#frag", "http://localhost:8080/", "ftp://files.example.org/pub/",
    "mailto:someone@example.com", "user.name+tag@sub.example.co.uk", "https://zh.wikipedia.org/wiki/中文",
    "file:///C:/Users/me/Documents/x.txt", "C:\\Windows\\System32\\drivers\\etc\\hosts", "/usr/local/bin/python3",
    "https://例え.jp/パス", "www.example.com", "192.168.0.1:443", "[2001:db8::1]:80",
]
SPECIAL = [
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<s>", "</s>", "<unk>", "<s>Hello</s>", "text <s> in </s> between", "<s><s></s></s>", "no<|im_end|>space",
    " <|im_start|> spaced ", "<|im_start|system", "<|im_start|><|im_end|>", "<|eot_id|> <|begin_of_text|>",
    "<repo_name>foo<file_sep>bar", "<0x41> literal byte token text", "[INST] hi [/INST]", "<think>hmm</think>",
    "<|im_start|>user\n你好 👋<|im_end|>", "</s> at start", "ends with <s>", "<<s>>", "<|<|im_end|>|>",
    "\u2581already\u2581has\u2581metaspace", "Ġbyte Ċlevel ĉchars", "\ufffd replacement char", "a\ufffdb",
]
LONG = [
    "a" * 1000, "supercalifragilisticexpialidocious" * 30, "pneumonoultramicroscopicsilicovolcanoconiosis",
    "ab" * 700, " " * 200, "\n" * 100, "🙂" * 150, "中" * 400, "x" * 64 + " " + "y" * 64,
    "Donaudampfschifffahrtselektrizitätenhauptbetriebswerkbauunterbeamtengesellschaft",
    "0123456789" * 40, "-" * 300, "=" * 120 + "\n" + "=" * 120, "aAbBcC" * 200, "é" * 300,
]

# Unicode ranges to draw random characters from (no surrogates).
BLOCKS = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
          (0xE00, 0xE7F), (0x1100, 0x11FF), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
          (0x2000, 0x206F), (0x2190, 0x23FF), (0x2500, 0x27BF), (0x1F300, 0x1FAFF), (0x10000, 0x1007F),
          (0x1D400, 0x1D7FF), (0x0300, 0x036F), (0xE000, 0xE0FF), (0xFE00, 0xFE0F), (0x1, 0x1F)]
SEPARATORS = ["", " ", "  ", "\n", "\t", "\r\n", " \n", "\n\n", "   "]


def _random_chars(rng: random.Random, n: int) -> str:
    lo, hi = rng.choice(BLOCKS)
    mix = rng.random() < 0.3
    out = []
    for _ in range(n):
        if mix:
            lo, hi = rng.choice(BLOCKS)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def build_corpus(seed: int = 20240601, n_random: int = 320) -> list[str]:
    """The hand-written samples followed by seeded mixtures, all distinct."""
    fixed = SCRIPTS + EMOJI + COMBINING + CODE + WHITESPACE + NUMBERS + PUNCT + URLS + SPECIAL + LONG
    rng = random.Random(seed)
    out = list(dict.fromkeys(fixed))
    seen = set(out)
    i = 0
    while len(out) < len(fixed) + n_random:
        kind = i % 4
        i += 1
        if kind == 0:  # a mixture of hand-written fragments
            parts = rng.sample(fixed[:-len(LONG)], rng.randint(2, 5))
            s = "".join(p + rng.choice(SEPARATORS) for p in parts)
        elif kind == 1:  # random characters
            s = _random_chars(rng, rng.randint(1, 40))
        elif kind == 2:  # words with random characters inside, whitespace around
            words = [rng.choice(["the", "token", "über", "数据", "😀", "x", "123", "<s>", "<|im_end|>", "don't"])
                     + (_random_chars(rng, rng.randint(0, 3)) if rng.random() < 0.5 else "")
                     for _ in range(rng.randint(1, 8))]
            s = rng.choice(["", " ", "\n"]) + rng.choice([" ", "  ", "\t", "\n"]).join(words) + rng.choice(SEPARATORS)
        else:  # a slice of a longer sample, cutting anywhere (inside words, grapheme clusters...)
            src = rng.choice(fixed)
            a = rng.randint(0, max(len(src) - 1, 0))
            s = src[a:a + rng.randint(1, 60)]
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


STRINGS: list[str] = build_corpus()

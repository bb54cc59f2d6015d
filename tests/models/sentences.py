"""200 varied sentences for embedding checks: short and long, punctuation, digits, accents, CJK,
emoji, code, whitespace oddities, and some far past a BERT model's 256-token limit."""
from __future__ import annotations

import random

_SUBJECTS = ["The cat", "A quantum computer", "My grandmother", "The Federal Reserve", "Photosynthesis",
             "Der Hund", "Le gouvernement français", "El niño", "東京の天気", "A 3.5-inch floppy disk",
             "GPT-style models", "The Rust borrow checker", "Île-de-France", "naïve café owners"]
_VERBS = ["explains", "ignores", "improves", "destroys", "celebrates", "predicts", "measures", "compiles",
          "translates", "questions"]
_OBJECTS = ["the weather in 2024", "a recursive function", "über-complex schemas", "42 apples and 7 pears",
            "the meaning of life", "distributed consensus (Raft, Paxos)", "¿qué hora es?", "emoji 😀🚀",
            "C:\\Program Files\\app.exe", "https://example.com/a?b=c&d=e", "SELECT * FROM users;",
            "x² + y² = z²", "— an em dash —", "$1,000,000.00"]


def varied_sentences(n: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 10
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
        if kind == 1:
            s = s.upper()
        elif kind == 2:
            s = "  ".join(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}" for _ in range(4))
        elif kind == 3:
            s = " ".join(rng.choice(_OBJECTS) for _ in range(60 + rng.randrange(80)))  # past 256 tokens
        elif kind == 4:
            s = rng.choice(["ok", "?", "Hi!", "a", "1234567890", "\tTabs\nand newlines\n"])
        elif kind == 5:
            s = "def f(x):\n    return x * 2  # " + s
        elif kind == 6:
            s = "".join(rng.choice("αβγδεζηθ日本語中文한국어") for _ in range(5 + rng.randrange(30)))
        out.append(s)
    return out

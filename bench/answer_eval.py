"""Do the built-in sampling defaults do harm? Short questions with checkable answers and open prompts, on smollm2.

Three settings, the same prompts, in one run:
  greedy        temperature 0, no penalty (the plain argmax answer)
  old defaults  temperature 0.2, top_p 0.9, repetition_penalty 1.1 over prompt and output (runlm before issue 31)
  defaults      the built-in catalogue's settings today (runlm/catalog.py)

For the questions it reports how many answers contain the expected answer (a sampled setting runs each seed and
reports the mean); for the open prompts, run to --open-tokens tokens, how many answers repeat a whole sentence
(runlm/bench's repeated_sentences: one of 20 characters or more written twice).

    .venv/bin/python bench/answer_eval.py [--seeds 0 1] [--open-tokens 256] [--questions 0] [--open 0]

Writes bench/results/answer_eval.json and prints a markdown table. About 2 minutes on 2 idle cores (the
sampled settings run once per seed; greedy ones once); several times that when the cores are shared.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

# (question, accepted answers: regexes searched in the lower-cased answer)
QUESTIONS: list[tuple[str, list[str]]] = [
    ("What is the capital of France? Answer in one word.", [r"\bparis\b"]),
    ("What is the capital of Japan? Answer in one word.", [r"\btokyo\b"]),
    ("What is the capital of Italy? Answer in one word.", [r"\brome\b"]),
    ("What is the capital of Germany? Answer in one word.", [r"\bberlin\b"]),
    ("What is the capital of Spain? Answer in one word.", [r"\bmadrid\b"]),
    ("What is the capital of the United Kingdom?", [r"\blondon\b"]),
    ("What is the capital of Egypt?", [r"\bcairo\b"]),
    ("What is the capital of Russia?", [r"\bmoscow\b"]),
    ("What is the capital city of China?", [r"\bbeijing\b"]),
    ("In which country is the Eiffel Tower?", [r"\bfrance\b", r"\bparis\b"]),
    ("Which planet is known as the Red Planet?", [r"\bmars\b"]),
    ("What is the largest planet in our solar system?", [r"\bjupiter\b"]),
    ("Which planet do we live on?", [r"\bearth\b"]),
    ("What star is at the center of our solar system?", [r"\bsun\b"]),
    ("What is the chemical symbol for water?", [r"\bh2o\b", r"h₂o"]),
    ("What gas do plants absorb from the air for photosynthesis?", [r"carbon dioxide", r"\bco2\b", r"co₂"]),
    ("What gas do humans need to breathe to live?", [r"\boxygen\b"]),
    ("At what temperature in degrees Celsius does water freeze?", [r"\b0\b", r"\bzero\b"]),
    ("At what temperature in degrees Celsius does water boil?", [r"\b100\b"]),
    ("How many days are there in a week?", [r"\b7\b", r"\bseven\b"]),
    ("How many months are there in a year?", [r"\b12\b", r"\btwelve\b"]),
    ("How many hours are there in a day?", [r"\b24\b", r"twenty-four"]),
    ("How many minutes are in an hour?", [r"\b60\b", r"\bsixty\b"]),
    ("How many legs does a spider have?", [r"\b8\b", r"\beight\b"]),
    ("How many legs does a dog have?", [r"\b4\b", r"\bfour\b"]),
    ("How many continents are there on Earth?", [r"\b7\b", r"\bseven\b"]),
    ("What is 2 + 2? Reply with the number only.", [r"\b4\b", r"\bfour\b"]),
    ("What is 3 + 5? Reply with the number only.", [r"\b8\b", r"\beight\b"]),
    ("What is 10 minus 3? Reply with the number only.", [r"\b7\b", r"\bseven\b"]),
    ("What is 6 times 7?", [r"\b42\b", r"forty-two"]),
    ("What is 9 + 10?", [r"\b19\b", r"nineteen"]),
    ("What is half of 10?", [r"\b5\b", r"\bfive\b"]),
    ("What color is the sky on a clear day?", [r"\bblue\b"]),
    ("What color is grass?", [r"\bgreen\b"]),
    ("What color are ripe bananas?", [r"\byellow\b"]),
    ("What color do you get by mixing blue and yellow?", [r"\bgreen\b"]),
    ("What is the opposite of hot?", [r"\bcold\b"]),
    ("What is the opposite of up?", [r"\bdown\b"]),
    ("What is the opposite of big?", [r"\bsmall\b", r"\blittle\b", r"\btiny\b"]),
    ("What animal says 'moo'?", [r"\bcows?\b"]),
    ("What animal is known as the king of the jungle?", [r"\blions?\b"]),
    ("What is the largest ocean on Earth?", [r"\bpacific\b"]),
    ("What is the tallest mountain in the world?", [r"\beverest\b"]),
    ("Who wrote 'Romeo and Juliet'?", [r"shakespeare"]),
    ("Who painted the Mona Lisa?", [r"leonardo", r"da vinci"]),
    ("Who was the first president of the United States?", [r"washington"]),
    ("What language is mainly spoken in Brazil?", [r"portuguese"]),
    ("What language is spoken in Germany?", [r"\bgerman\b"]),
    ("What is the freezing point of water in Fahrenheit?", [r"\b32\b"]),
    ("What is the first letter of the English alphabet?", [r"\ba\b"]),
    ("Translate 'hello' into Spanish.", [r"\bhola\b"]),
    ("Translate 'thank you' into French.", [r"\bmerci\b"]),
    ("Write the word 'cat' in capital letters.", [r"\bcat\b"]),  # checked case-sensitively below
    ("Spell the word 'dog' backwards.", [r"\bgod\b", r"g-o-d"]),
    ("Complete the sentence: The early bird catches the ...", [r"\bworm\b"]),
    ("Name the primary color that is also the color of blood.", [r"\bred\b"]),
    ("Is the Sun a star or a planet? Answer in one word.", [r"\bstar\b"]),
    ("Answer yes or no: Is ice cold?", [r"\byes\b"]),
]
CASE_SENSITIVE = {"Write the word 'cat' in capital letters.": r"\bCAT\b"}

OPEN_PROMPTS = [
    "Why is the sky blue?", "Tell me about Paris.", "Write a short story about a cat.",
    "Explain how a computer works.", "Describe your ideal weekend.", "What are the benefits of exercise?",
    "Explain photosynthesis to a child.", "Write a poem about the sea.", "How do airplanes fly?",
    "Give me some tips for learning a new language.", "What is machine learning?",
    "Tell me about the history of the Roman Empire.", "Why do we need sleep?", "Describe a rainy day in a city.",
    "How does the internet work?", "Write a letter to a friend about your holiday.",
    "What makes a good teacher?", "Explain the water cycle.", "Tell me a story about a dragon and a knight.",
    "What should I cook for dinner tonight?", "Describe how to plant a tree.", "Why is recycling important?",
]


def repeated_sentences(text: str) -> list[str]:
    """Sentences (20 characters or more) that occur more than once."""
    sentences = [s.strip().lower() for s in re.split(r"[.!?\n]+", text) if len(s.strip()) >= 20]
    return sorted({s for s in sentences if sentences.count(s) > 1})


def correct(question: str, answer: str) -> bool:
    if question in CASE_SENSITIVE:
        return re.search(CASE_SENSITIVE[question], answer) is not None
    low = answer.lower()
    return any(re.search(p, low) for p in dict(QUESTIONS)[question])


def settings() -> dict[str, dict]:
    from runlm.catalog import SMOLLM2_SAMPLING

    return {"greedy": {"temperature": 0.0},
            "old defaults": {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1},
            "defaults": dict(SMOLLM2_SAMPLING),
            # the candidates measured on the way (not run unless named with --settings)
            "greedy + DRY": {"temperature": 0.0, "dry_multiplier": 0.8},
            "0.2 / 0.9 + DRY": {"temperature": 0.2, "top_p": 0.9, "dry_multiplier": 0.8}}


def evaluate(llm, setting: dict, seeds: list[int], questions: list[tuple[str, list[str]]], open_prompts: list[str],
             question_tokens: int, open_tokens: int) -> dict:
    from runlm.engine.types.sampling_params import SamplingParams

    def chat(text: str) -> dict:
        return {"prompt_token_ids": llm.encode_chat([{"role": "user", "content": text}])}

    sampled = setting.get("temperature", 1.0) > 0.0
    runs = seeds if sampled else seeds[:1]
    scores, repeats, answers = [], 0, []
    for seed in runs:
        qs = llm.generate([chat(q) for q, _ in questions],
                          SamplingParams(**setting, max_tokens=question_tokens, seed=seed), use_tqdm=False)
        ok = [correct(q, o.outputs[0].text) for (q, _), o in zip(questions, qs)]
        scores.append(sum(ok))
        outs = llm.generate([chat(p) for p in open_prompts],
                            SamplingParams(**setting, max_tokens=open_tokens, seed=seed), use_tqdm=False)
        for p, o in zip(open_prompts, outs):
            rep = repeated_sentences(o.outputs[0].text)
            repeats += bool(rep)
            answers.append({"seed": seed, "prompt": p, "repeats": rep, "text": o.outputs[0].text})
        answers += [{"seed": seed, "question": q, "correct": c, "text": o.outputs[0].text}
                    for (q, _), c, o in zip(questions, ok, qs)]
    return {"setting": setting, "runs": len(runs), "correct": sum(scores) / len(runs), "scores": scores,
            "open_answers": len(runs) * len(open_prompts), "repeating": repeats, "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--question-tokens", type=int, default=48)
    ap.add_argument("--open-tokens", type=int, default=256)
    ap.add_argument("--questions", type=int, default=0, help="only the first N questions (0: all)")
    ap.add_argument("--open", type=int, default=0, help="only the first N open prompts (0: all)")
    ap.add_argument("--settings", nargs="+", default=["greedy", "old defaults", "defaults"],
                    help="which settings to run (names in settings())")
    ap.add_argument("--out", default="bench/results/answer_eval.json")
    args = ap.parse_args()

    from runlm.catalog import resolve_model
    from runlm.engine.factory import engine_config, engine_from_config
    from runlm.engine.llm import LLM

    questions = QUESTIONS[:args.questions or None]
    open_prompts = OPEN_PROMPTS[:args.open or None]
    llm = LLM(engine=engine_from_config(engine_config(resolve_model(args.model),
                                                      max_num_seqs=max(len(questions), len(open_prompts)))))
    results = {}
    for name, setting in ((n, settings()[n]) for n in args.settings):
        t = time.perf_counter()
        results[name] = evaluate(llm, setting, args.seeds, questions, open_prompts, args.question_tokens,
                                 args.open_tokens)
        results[name]["seconds"] = round(time.perf_counter() - t, 1)
        print(f"{name}: {results[name]['correct']}/{len(questions)} correct, {results[name]['repeating']}/"
              f"{results[name]['open_answers']} repeating ({results[name]['seconds']} s)", flush=True)
    print(f"\n| setting | sampling | questions correct (of {len(questions)}) | open answers repeating a sentence |")
    print("|---|---|---|---|")
    for name, r in results.items():
        shown = ", ".join(f"{k} {v}" for k, v in r["setting"].items())
        print(f"| {name} | {shown} | {r['correct']:g} ({'/'.join(map(str, r['scores']))}) "
              f"| {r['repeating']} of {r['open_answers']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "seeds": args.seeds, "open_tokens": args.open_tokens,
                               "results": results}, indent=1))


if __name__ == "__main__":
    main()

"""What a content policy costs (`stratum.server.policy`): the answer screen per streamed token, and the
prompt screen per megabyte, with thousands of terms and a few RE2 patterns (a hostile one among them).

Seeded words make the terms (two or three words each) and the texts; an answer is fed to an
`AnswerScreen` in pieces of about a token (4 characters), as the server feeds it deltas; no term occurs
in the texts, so every piece is screened to the end (the cost of a clean answer). Run as
`stratum bench policy`; prints one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time

from stratum.server.policy import AnswerScreen, Matcher, parse_policy, screen_prompt

PATTERNS = [r"\b\d{4}[ -]?\d{4}[ -]?\d{4}[ -]?\d{4}\b", r"[\w.+-]+@[\w-]+\.[\w.]+", r"sk-[a-z0-9]{20,}",
            r"(a+)+$", r"\b(?:\d{1,3}\.){3}\d{1,3}\b"]


def make_words(rng: random.Random, n: int) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(n)]


def make_matcher(num_terms: int, seed: int) -> Matcher:
    rng = random.Random(seed)
    vocab = make_words(rng, 4000)
    terms = [" ".join(rng.sample(vocab, rng.randint(2, 3))) + " zq" for _ in range(num_terms)]  # never in the text
    rules = [{"id": "terms", "action": "block", "terms": terms}]
    rules += [{"id": f"pattern-{i}", "action": "mask", "pattern": p} for i, p in enumerate(PATTERNS)]
    return Matcher(parse_policy({"rules": rules}))


def answer_us_per_token(matcher: Matcher, text: str, piece: int, repeats: int) -> dict:
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    runs = []
    for _ in range(repeats):
        screen = AnswerScreen(matcher)
        t0 = time.perf_counter()
        for p in pieces:
            screen.feed(p)
        screen.feed("", is_last=True)
        runs.append((time.perf_counter() - t0) / len(pieces) * 1e6)
        assert screen.blocked is None
    return {"tokens": len(pieces), "us_per_token_median": round(statistics.median(runs), 2),
            "us_per_token_min": round(min(runs), 2)}


def prompt_ms_per_mb(matcher: Matcher, text: str, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        assert screen_prompt(matcher, [text]).blocked is None
        runs.append(time.perf_counter() - t0)
    return round(statistics.median(runs) / (len(text.encode()) / 2**20) * 1e3, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stratum bench policy", description=__doc__)
    p.add_argument("--terms", type=int, nargs="+", default=[1000, 5000, 20000])
    p.add_argument("--answer-chars", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed + 1)
    words = make_words(rng, 2000)
    answer = " ".join(rng.choice(words) for _ in range(args.answer_chars // 6))[:args.answer_chars]
    prompt = (answer + " ") * (2**20 // (len(answer) + 1))
    accented = prompt.replace("e", "é").replace("o", "ö")  # not ASCII: the per-character normalization
    results = []
    for n in args.terms:
        t0 = time.perf_counter()
        matcher = make_matcher(n, args.seed)
        build_s = time.perf_counter() - t0
        row = {"terms": n, "patterns": len(PATTERNS), "reach_chars": matcher.reach, "build_ms": round(build_s * 1e3, 1),
               "answer": answer_us_per_token(matcher, answer, 4, args.repeats),
               "prompt_ascii_ms_per_mb": prompt_ms_per_mb(matcher, prompt, args.repeats),
               "prompt_unicode_ms_per_mb": prompt_ms_per_mb(matcher, accented, max(1, args.repeats // 2))}
        results.append(row)
        print(f"terms {n}: {row}", file=sys.stderr)
    print(json.dumps({"benchmark": "policy", "machine": platform.processor() or platform.machine(),
                      "python": platform.python_version(), "token_chars": 4, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Greedy outputs of the default model for a fixed set of prompts, solo and batched, as JSON.

Run it on two versions of the code to check that a change kept every output byte for byte:

    python scripts/greedy_outputs.py > after.json
    PYTHONPATH=/path/to/other/checkout python scripts/greedy_outputs.py > before.json
    cmp before.json after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

PROMPTS = [
    "What is the capital of Japan?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "Translate 'good morning' into French.", "What is 17 times 23?",
    "Name a famous painting by Van Gogh.", "Give me a synonym for 'happy'.", "Why is the sky blue?",
    "Write a Python function that reverses a string.", "What year did the Second World War end?",
    "Describe a cat in five words.", "What is the boiling point of water in Fahrenheit?",
    "Suggest a name for a bakery.", "How many legs does a spider have?", "Summarize the plot of Cinderella.",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    from stratum.engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    template = llm.engine.chat_template
    prompts = [template.encode([{"role": "user", "content": q}]) for q in PROMPTS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    solo = [llm.generate([ids], params)[0] for ids in prompts]
    batched = llm.generate(prompts, params)
    doc = {"module": sys.modules["stratum.engine"].__file__, "dtype": str(llm.engine.config.torch_dtype),
           "solo": [{"text": o.text, "token_ids": o.token_ids} for o in solo],
           "batched": [{"text": o.text, "token_ids": o.token_ids} for o in batched]}
    doc["digest"] = hashlib.sha256(json.dumps([doc["solo"], doc["batched"]]).encode()).hexdigest()
    json.dump(doc, sys.stdout, indent=1, ensure_ascii=False)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

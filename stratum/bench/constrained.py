"""What constrained decoding costs per decode step: the same batch, with and without a grammar.

Each run decodes `batch` requests together (seeded word prompts, temperature 1, a fixed seed each,
exactly max_tokens each), once free and once under a grammar that keeps every step inside a JSON
string value (the state most of a tool call's or a structured answer's tokens are sampled in). It
reports, per full decode step, the wall time of the step and of the grammar masks alone, as the
engine measured them (`StepStats.mask_s`). Run as `stratum bench constrained`; prints one JSON
document on stdout.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

from stratum.bench.offline import make_prompts
from stratum.engine import LLM
from stratum.engine.sampling_params import SamplingParams

# {"text": "... and a string that goes on: never complete, so no request stops before max_tokens.
LARK = 'start: "{\\"text\\": \\"" CHARS\nCHARS: /([^"\\\\\\x00-\\x1f]|\\\\["\\\\nt])*/\n'


def run(llm: LLM, prompts: list[list[int]], grammar: str | None, max_tokens: int) -> dict:
    engine = llm.engine
    engine.step_stats.clear()
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True, grammar=grammar)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    steps = [s for s in engine.step_stats if s.num_decode_seqs == s.num_seqs == len(prompts)]  # full decode steps
    step_ms = [1e3 * s.step_s for s in steps]
    mask_ms = [1e3 * s.mask_s for s in steps]
    return {"decode_steps": len(steps), "step_ms_mean": round(statistics.fmean(step_ms), 3),
            "step_ms_p50": round(statistics.median(step_ms), 3), "mask_ms_mean": round(statistics.fmean(mask_ms), 4),
            "mask_ms_p99": round(sorted(mask_ms)[int(0.99 * (len(mask_ms) - 1))], 4),
            "output_tokens": sum(len(o.token_ids) for o in outs)}


def main(argv: list[str] | None = None) -> int:
    import llguidance

    p = argparse.ArgumentParser(prog="stratum bench constrained", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    args = p.parse_args(argv)
    llm = LLM(args.model)
    grammar = llguidance.LLMatcher.grammar_from_lark(LARK)
    results = []
    for batch in args.batch:
        prompts = make_prompts(llm.engine.tokenizer, batch, (args.prompt_tokens, args.prompt_tokens), seed=batch)
        run(llm, prompts[:1], grammar, 2)  # warm: the grammar's vocabulary view is built once per engine
        free = run(llm, prompts, None, args.max_tokens)
        constrained = run(llm, prompts, grammar, args.max_tokens)
        results.append({"batch": batch, "free": free, "constrained": constrained,
                        "step_overhead_ms": round(constrained["step_ms_mean"] - free["step_ms_mean"], 3),
                        "step_ratio": round(constrained["step_ms_mean"] / free["step_ms_mean"], 4)})
        print(f"batch {batch}: {results[-1]}", file=sys.stderr)
    print(json.dumps({"benchmark": "constrained", "model": args.model,
                      "machine": platform.processor() or platform.machine(),
                      "threads": llm.engine.config.num_threads, "kernels": llm.engine.kernel_choices["dtype"],
                      "max_tokens": args.max_tokens, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

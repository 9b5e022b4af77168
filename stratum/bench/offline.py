"""Offline throughput: Stratum at several concurrency levels, and transformers `generate()` on the same prompts.

Every request gets a seeded random word prompt (exact token length drawn from a range), greedy
decoding and exactly `max_tokens` output tokens (EOS ignored), so every engine does the same work.
Run as `stratum bench offline [--options]`; prints one JSON document on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from stratum.bench.workloads import WORDS
from stratum.engine import LLM
from stratum.engine.sampling_params import SamplingParams

DEFAULT_CONCURRENCIES = (1, 8, 32, 64)
DEFAULT_HF_DTYPES = ("float32", "bfloat16")
DEFAULT_HF_BATCH_SIZES = (1, 16)

# Prompts are drawn from the serving benchmark's word list: ordinary English for any BPE vocabulary.



def make_prompts(tokenizer, num_prompts: int, prompt_len: tuple[int, int], seed: int) -> list[list[int]]:
    """Seeded random word prompts, each cut to an exact token length drawn uniformly from prompt_len."""
    rng = random.Random(seed)
    lo, hi = prompt_len
    prompts = []
    for _ in range(num_prompts):
        target = rng.randint(lo, hi)
        words: list[str] = []
        ids: list[int] = []
        while len(ids) < target:
            words += rng.choices(WORDS, k=32)
            ids = tokenizer.encode(" ".join(words).capitalize())
        prompts.append(ids[:target])
    return prompts


def _step_totals(stats) -> dict[str, float]:
    step_s = sum(s.step_s for s in stats)
    forward_s = sum(s.forward_s for s in stats)
    return {
        "num_steps": len(stats),
        "step_s": round(step_s, 4),
        "forward_s": round(forward_s, 4),
        # Everything in a step that is not the model forward: scheduling, tensor preparation, sampling, postprocess.
        "overhead_ratio": round((step_s - forward_s) / step_s, 4) if step_s else None,
    }


def run_stratum(llm: LLM, prompts: list[list[int]], concurrencies, max_tokens: int, log) -> list[dict[str, Any]]:
    """One batch of `c` concurrent requests per level; the engine admits them all at once."""
    engine = llm.engine
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    levels = []
    for c in concurrencies:
        batch = prompts[:c]
        engine.step_stats.clear()
        t0 = time.perf_counter()
        outs = llm.generate(batch, sampling)
        wall = time.perf_counter() - t0
        num_out = sum(len(o.token_ids) for o in outs)
        assert num_out == c * max_tokens, "ignore_eos requests must produce exactly max_tokens"
        stats = list(engine.step_stats)
        assert len(stats) < engine.step_stats.maxlen, "step_stats overflowed; raise its maxlen"
        decode_steps = [s for s in stats if s.num_decode_seqs == c]
        level = {
            "concurrency": c,
            "num_prompt_tokens": sum(len(p) for p in batch),
            "num_output_tokens": num_out,
            "wall_s": round(wall, 3),
            "output_tok_s": round(num_out / wall, 2),
            "total_tok_s": round((num_out + sum(len(p) for p in batch)) / wall, 2),
            **_step_totals(stats),
            "full_batch_decode_step_ms": round(1000 * sum(s.step_s for s in decode_steps) / len(decode_steps), 2)
            if decode_steps else None,
        }
        log(f"stratum c={c}: {level['output_tok_s']} tok/s, overhead {level['overhead_ratio']}, {wall:.1f}s")
        levels.append(level)
    return levels


def _load_transformers_model(path: Path):
    import transformers

    transformers.logging.set_verbosity_error()
    if path.is_file():
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                 dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _hf_generate(model, batch: list[list[int]], max_tokens: int, pad_id: int) -> float:
    """Greedy generate for a left-padded batch; returns wall seconds. Exactly max_tokens new tokens each."""
    width = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id)
    wall = time.perf_counter() - t0
    assert out.shape == (len(batch), width + max_tokens), f"transformers produced {tuple(out.shape)}"
    return wall


def run_transformers(path: Path, prompts: list[list[int]], max_tokens: int, dtypes, batch_sizes,
                     num_b1_prompts: int, pad_id: int, log) -> dict[str, Any]:
    """transformers generate() on the same prompts: batch 1 over the first num_b1_prompts prompts, larger
    batches as one left-padded batch of the first `b` prompts. fp32 runs first; bf16 casts the same weights."""
    try:
        import transformers
    except ImportError as e:
        return {"skipped": f"transformers is not importable ({e}); install it to compare"}
    t0 = time.perf_counter()
    model = _load_transformers_model(path)
    result: dict[str, Any] = {"version": transformers.__version__, "load_s": round(time.perf_counter() - t0, 2),
                              "runs": []}
    for dtype in sorted(dtypes, key=lambda d: d != "float32"):  # casting down is one way
        model = model.to(getattr(torch, dtype))
        _hf_generate(model, prompts[:1], 4, pad_id)  # warm-up
        for b in batch_sizes:
            if b == 1:
                batches = [[p] for p in prompts[:num_b1_prompts]]
            else:
                batches = [prompts[:b]]
            wall = sum(_hf_generate(model, batch, max_tokens, pad_id) for batch in batches)
            num_out = sum(len(batch) for batch in batches) * max_tokens
            run = {"dtype": dtype, "batch_size": b, "num_requests": sum(len(x) for x in batches),
                   "num_output_tokens": num_out, "wall_s": round(wall, 3), "output_tok_s": round(num_out / wall, 2)}
            log(f"transformers {dtype} b={b}: {run['output_tok_s']} tok/s, {wall:.1f}s")
            result["runs"].append(run)
    return result


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "loadavg_at_start": _loadavg()}


def _loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other work on the machine skews every number here."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_offline(
    model: str = "smollm2-135m",
    concurrencies=DEFAULT_CONCURRENCIES,
    max_tokens: int = 64,
    prompt_len: int | tuple[int, int] = (64, 128),
    seed: int = 0,
    dtype: str = "float32",
    compare_hf: bool = True,
    hf_dtypes=DEFAULT_HF_DTYPES,
    hf_batch_sizes=DEFAULT_HF_BATCH_SIZES,
    hf_b1_prompts: int = 4,
    num_threads: int | None = None,
    log=lambda msg: print(msg, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Measure aggregate output tokens/s and runtime overhead at each concurrency, then transformers.

    Args:
        model: a registered name, a .gguf file or a Hugging Face folder.
        prompt_len: an exact prompt length in tokens, or an inclusive (min, max) range.
        compare_hf: also run transformers generate() (skipped with a note if it cannot be imported).
    Returns:
        A JSON-serialisable dict: settings, machine, "stratum" levels, "transformers" runs and "ratios".
    Raises:
        PullError: a registered model that is not pulled; ModelLoadError: an unloadable path.
    """
    from stratum.models.registry import resolve_model_path

    t_start = time.perf_counter()
    lo, hi = (prompt_len, prompt_len) if isinstance(prompt_len, int) else tuple(prompt_len)
    concurrencies = tuple(concurrencies)
    path = resolve_model_path(model)
    num_prompts = max([*concurrencies, *(b for b in hf_batch_sizes if compare_hf), hf_b1_prompts if compare_hf else 0])
    block_size = 16
    # Room for every request of the largest level at full length, so nothing is preempted.
    num_kv_blocks = max(concurrencies) * -(-(hi + max_tokens) // block_size) + 16
    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, device="cpu", enable_prefix_cache=False, num_kv_blocks=num_kv_blocks,
              block_size=block_size, num_threads=num_threads)
    load_s = time.perf_counter() - t0
    engine = llm.engine
    prompts = make_prompts(engine.tokenizer, num_prompts, (lo, hi), seed)
    log(f"stratum: loaded {path.name} in {load_s:.1f}s; {num_prompts} prompts of {lo}-{hi} tokens, "
        f"{max_tokens} output tokens each")
    sched = engine.config.scheduler
    result: dict[str, Any] = {
        "benchmark": "offline",
        "model": model,
        "model_file": path.name,
        "seed": seed,
        "max_tokens": max_tokens,
        "prompt_len": [lo, hi],
        "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
        "sampling": "greedy, ignore_eos (exactly max_tokens per request)",
        "machine": _machine(),
        "stratum": {
            "dtype": engine.config.dtype,
            "device": engine.config.device,
            "load_s": round(load_s, 2),
            "kernels": engine.kernel_choices,  # the numerics key, dtypes, step and threads, as the engine chose them
            "prefix_cache": False,  # levels reuse the same prompts; a cache would skip their prefill
            "block_size": block_size,
            "num_kv_blocks": num_kv_blocks,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs,
            "levels": run_stratum(llm, prompts, concurrencies, max_tokens, log),
        },
    }
    pad_id = engine.model_config.eos_token_ids[0] if engine.model_config.eos_token_ids else 0
    del llm, engine
    if compare_hf:
        result["transformers"] = run_transformers(path, prompts, max_tokens, hf_dtypes, hf_batch_sizes,
                                                  hf_b1_prompts, pad_id, log)
    else:
        result["transformers"] = {"skipped": "disabled (--no-hf)"}
    result["ratios"] = _ratios(result)
    result["machine"]["loadavg_at_end"] = _loadavg()
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    return result


def _ratios(result: dict[str, Any]) -> dict[str, Any]:
    """Stratum at its highest concurrency over the best transformers batched run, and c=1 over batch 1."""
    levels = {lv["concurrency"]: lv["output_tok_s"] for lv in result["stratum"]["levels"]}
    runs = result["transformers"].get("runs", [])
    ratios: dict[str, Any] = {}
    top = max(levels)
    batched = [r for r in runs if r["batch_size"] > 1]
    if batched:
        best = max(batched, key=lambda r: r["output_tok_s"])
        ratios[f"stratum_c{top}_over_best_hf_b{best['batch_size']}"] = round(levels[top] / best["output_tok_s"], 2)
        ratios["best_hf_batched"] = {k: best[k] for k in ("dtype", "batch_size", "output_tok_s")}
    single = [r for r in runs if r["batch_size"] == 1]
    if single and 1 in levels:
        best1 = max(single, key=lambda r: r["output_tok_s"])
        ratios["stratum_c1_over_best_hf_b1"] = round(levels[1] / best1["output_tok_s"], 2)
        ratios["best_hf_b1"] = {k: best1[k] for k in ("dtype", "batch_size", "output_tok_s")}
    return ratios


def _prompt_len(text: str) -> int | tuple[int, int]:
    lo, _, hi = text.partition(":")
    return (int(lo), int(hi)) if hi else int(lo)


def main(argv: list[str] | None = None) -> int:
    """`stratum bench offline`: run the benchmark and print its JSON. Returns the exit status."""
    p = argparse.ArgumentParser(prog="stratum bench offline", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or Hugging Face folder")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCIES),
                   help="concurrent requests per level (default: 1 8 32 64)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    p.add_argument("--prompt-len", type=_prompt_len, default=(64, 128), help="tokens per prompt: N or MIN:MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="Stratum's dtype")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument("--hf-dtypes", nargs="+", default=list(DEFAULT_HF_DTYPES), choices=["float32", "bfloat16"])
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=list(DEFAULT_HF_BATCH_SIZES))
    p.add_argument("--hf-b1-prompts", type=int, default=4, help="prompts run one at a time for transformers batch 1")
    p.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)

    from stratum.models.loader import ModelLoadError
    from stratum.models.registry import PullError

    try:
        result = run_offline(args.model, args.concurrency, args.max_tokens, args.prompt_len, args.seed, args.dtype,
                             compare_hf=not args.no_hf, hf_dtypes=args.hf_dtypes, hf_batch_sizes=args.hf_batch_sizes,
                             hf_b1_prompts=args.hf_b1_prompts, num_threads=args.threads)
    except (PullError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`stratum bench compare`: the same seeded workload against several servers in turn, side by side.

Each URL gets exactly what `stratum bench serve` would send it. Prints one JSON document; optionally writes a
markdown table of the key figures with ratios against the first URL, and PNG charts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from stratum.bench.serve import (BenchError, add_bench_args, check_args, config_doc, emit, make_target, result_doc,
                                 run_target, write_plots)

# (row label, path into a level's figures). Ratios are plain value / first value; the row says which way is better.
KEY_FIGURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("completed", ("completed",)),
    ("failed", ("failed",)),
    ("output tok/s (higher is better)", ("output_tok_s",)),
    ("requests/s (higher is better)", ("request_throughput",)),
    ("TTFT p50 ms", ("ttft_ms", "p50")),
    ("TTFT p90 ms", ("ttft_ms", "p90")),
    ("TTFT p99 ms", ("ttft_ms", "p99")),
    ("TTFT jitter p99/p50", ("ttft_jitter",)),
    ("TPOT p50 ms", ("tpot_ms", "p50")),
    ("TPOT p99 ms", ("tpot_ms", "p99")),
    ("ITL p50 ms", ("itl_ms", "p50")),
    ("ITL p99 ms", ("itl_ms", "p99")),
    ("E2E p50 ms", ("e2e_ms", "p50")),
    ("E2E p99 ms", ("e2e_ms", "p99")),
    ("prompt tokens", ("prompt_tokens",)),
    ("cached prompt tokens", ("cached_prompt_tokens",)),
    ("cached ratio (higher is better)", ("cached_ratio",)),
    ("goodput req/s (higher is better)", ("goodput", "req_s")),
    ("short-request TTFT p50 ms", ("short_ttft_ms", "p50")),
    ("short-request TTFT p99 ms", ("short_ttft_ms", "p99")),
)


def figure(level: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = level
    for key in path:
        if not isinstance(value, dict) or value.get(key) is None:
            return None
        value = value[key]
    return value


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return round(value / base, 3)


def _fmt(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:,}" if isinstance(x, int) else f"{x:,.3g}" if abs(x) < 100 else f"{x:,.1f}"


def levels_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc["sweep"] if "sweep" in doc else [doc]


def markdown_table(labels: list[str], levels: list[dict[str, Any]]) -> str:
    """One table for one load level: a column per target, then one ratio column per target after the first.

    Rows with no value for any target (short-request TTFT outside mixed-long) are left out."""
    head = ["metric", *labels, *(f"{x} / {labels[0]}" for x in labels[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for name, path in KEY_FIGURES:
        values = [figure(level, path) for level in levels]
        if all(v is None for v in values):
            continue
        ratios = [ratio(v, values[0]) for v in values[1:]]
        cells = [_fmt(v) for v in values] + [f"{r:.3f}×" if r is not None else "–" for r in ratios]
        lines.append("| " + " | ".join([name, *cells]) + " |")
    return "\n".join(lines)


def markdown_report(labels: list[str], docs: list[dict[str, Any]]) -> str:
    cfg = docs[0]["config"]
    out = [f"# stratum bench compare: {cfg['workload']}, {cfg['api']} API", "",
           f"{cfg['num_requests']} requests, max_tokens {cfg['max_tokens']}, ignore_eos {cfg['ignore_eos']}, "
           f"seed {cfg['workload_config']['seed']}. Targets: "
           + ", ".join(f"{label} = {d['config']['url']} ({d['config']['model']})" for label, d in zip(labels, docs)),
           ""]
    per_target = [levels_of(d) for d in docs]
    for i, first in enumerate(per_target[0]):
        if len(per_target[0]) > 1 or first.get("rate") is not None:
            load = f"concurrency {first['concurrency']}" if first.get("rate") is None else f"rate {first['rate']}/s"
            out += [f"## {load}", ""]
        out += [markdown_table(labels, [levels[i] for levels in per_target]), ""]
    return "\n".join(out)


def default_labels(urls: list[str]) -> list[str]:
    from urllib.parse import urlsplit

    labels = [urlsplit(u).netloc or u for u in urls]
    return [x if labels.count(x) == 1 else f"{x}#{i + 1}" for i, x in enumerate(labels)]


def main(argv: list[str] | None = None) -> int:
    """`stratum bench compare`: run the workload against every --url and print the JSON. Returns the exit status."""
    p = argparse.ArgumentParser(prog="stratum bench compare", description=__doc__.splitlines()[0])
    p.add_argument("--url", action="append", required=True, help="a server base URL (repeat; the first is the base)")
    p.add_argument("--label", action="append", default=None, help="a name per --url, in order")
    p.add_argument("--markdown", type=Path, default=None, help="write the side-by-side table here")
    add_bench_args(p)
    args = p.parse_args(argv)
    check_args(p, args)
    if args.label is not None and len(args.label) != len(args.url):
        p.error(f"{len(args.label)} --label for {len(args.url)} --url")
    labels = args.label or default_labels(args.url)
    try:  # refuse any bad URL before loading the first server
        targets = [make_target(url, args) for url in args.url]
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs_by_label = {}
    docs = []
    for label, target in zip(labels, targets):
        runs = run_target(target, args, label)
        runs_by_label[label] = runs
        docs.append(result_doc(args, target, runs))
    base_levels = levels_of(docs[0])
    doc: dict[str, Any] = {
        "benchmark": "compare",
        "config": {k: v for k, v in config_doc(args, targets[0]).items() if k not in ("url", "model")},
        "targets": [{"label": label, **{k: v for k, v in d.items() if k != "benchmark"}}
                    for label, d in zip(labels, docs)],
        "ratios_vs_first": {
            label: [{name: ratio(figure(lv, path), figure(base, path)) for name, path in KEY_FIGURES}
                    for lv, base in zip(levels_of(d), base_levels)]
            for label, d in zip(labels[1:], docs[1:])
        },
    }
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown_report(labels, docs))
        doc["markdown"] = str(args.markdown)
    if args.plot is not None:
        doc["plots"] = [str(x) for x in write_plots(args.plot, runs_by_label, f"{args.workload}, {args.api}")]
    emit(doc, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

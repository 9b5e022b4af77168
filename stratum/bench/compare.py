"""`stratum bench compare`: the same seeded workload against several servers in turn, side by side.

Each URL gets exactly what `stratum bench serve` would send it. Prints one JSON document; optionally writes a
markdown table of the key figures with ratios against the first URL, and PNG charts.

With --rounds N the targets run N times in alternating order (round r on seed + r, so no round finds
another's prompts in a prefix cache): each target's figures are over all its rounds, and `by_round`
holds each round's ratios against the first target and their medians. On a machine whose speed
drifts (a shared host, a VM), one target's run then another's compares two moments; a round compares
one, and the median of the rounds is the side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from stratum.bench.serve import (BenchError, LevelRun, add_bench_args, check_args, config_doc, emit, make_target,
                                 result_doc, run_target, summarize, write_plots)

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


# What `by_round` compares per round (name, path into a level's figures).
ROUND_FIGURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("output_tok_s", ("output_tok_s",)),
    ("tpot_ms_p50", ("tpot_ms", "p50")),
    ("ttft_ms_p50", ("ttft_ms", "p50")),
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


def run_rounds(args: argparse.Namespace, labels: list[str], targets: list) -> tuple[dict[str, list], dict[str, Any]]:
    """The targets args.rounds times, in alternating order, round r on seed + r (the warm-ups in the
    first only). Returns each label's one level over every round (its requests together, its duration
    the rounds' sum), and `by_round`: each round's figures, and per label after the first its ratios
    against the first target by round and their median."""
    rounds: list[dict[str, LevelRun]] = []
    pairs = list(zip(labels, targets))
    load = None
    for r in range(args.rounds):
        round_args = argparse.Namespace(**{**vars(args), "seed": args.seed + r,
                                           "num_warmups": args.num_warmups if r == 0 else 0})
        rounds.append({})
        for label, target in pairs if r % 2 == 0 else pairs[::-1]:
            [(load, run)] = run_target(target, round_args, f"{label} round {r + 1}")
            rounds[-1][label] = run
    merged = {}
    for label in labels:
        runs = [rd[label] for rd in rounds]
        results = [x for run in runs for x in run.results]
        summary = summarize(results, sum(run.summary["duration_s"] for run in runs),
                            sum(run.summary["num_requests"] for run in runs), args.slo_ttft_ms, args.slo_tpot_ms,
                            sum(run.summary["cancelled"] for run in runs))
        merged[label] = [(load, LevelRun(summary, results))]
    figures = [{label: {name: figure(rd[label].summary, path) for name, path in ROUND_FIGURES} for label in labels}
               for rd in rounds]
    ratios = {label: {name: [ratio(f[label][name], f[labels[0]][name]) for f in figures] for name, _ in ROUND_FIGURES}
              for label in labels[1:]}
    median = {label: {name: (round(statistics.median(v), 3) if None not in v else None) for name, v in by_name.items()}
              for label, by_name in ratios.items()}
    return merged, {"seeds": [args.seed + r for r in range(args.rounds)], "figures": figures,
                    "ratios_vs_first": ratios, "median_ratios_vs_first": median}


def rounds_table(labels: list[str], by_round: dict[str, Any]) -> str:
    """Each round's output tok/s and TPOT p50 per target, the ratios against the first, and their median."""
    others = labels[1:]
    head = ["round", *(f"{x} tok/s" for x in labels), *(f"{x} / {labels[0]} tok/s" for x in others),
            *(f"{x} TPOT p50 ms" for x in labels), *(f"{x} / {labels[0]} TPOT" for x in others)]
    lines = ["", "## By round", "", "| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    ratios, median = by_round["ratios_vs_first"], by_round["median_ratios_vs_first"]
    for i, f in enumerate(by_round["figures"]):
        row = [str(i + 1), *(_fmt(f[x]["output_tok_s"]) for x in labels),
               *(_fmt(ratios[x]["output_tok_s"][i]) for x in others),
               *(_fmt(f[x]["tpot_ms_p50"]) for x in labels), *(_fmt(ratios[x]["tpot_ms_p50"][i]) for x in others)]
        lines.append("| " + " | ".join(row) + " |")
    blank = [""] * len(labels)
    lines.append("| " + " | ".join(["median", *blank, *(f"**{_fmt(median[x]['output_tok_s'])}**" for x in others),
                                     *blank, *(f"**{_fmt(median[x]['tpot_ms_p50'])}**" for x in others)]) + " |")
    return "\n".join(lines) + "\n"


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
    p.add_argument("--rounds", type=int, default=1,
                   help="run the targets this many times in alternating order, round r on seed + r; the ratios "
                        "of each round and their median under by_round (one load level: no --sweep)")
    add_bench_args(p)
    args = p.parse_args(argv)
    check_args(p, args)
    if args.rounds < 1:
        p.error("--rounds must be positive")
    if args.rounds > 1 and args.sweep:
        p.error("--rounds runs one load level; --sweep runs several")
    if args.label is not None and len(args.label) != len(args.url):
        p.error(f"{len(args.label)} --label for {len(args.url)} --url")
    labels = args.label or default_labels(args.url)
    try:  # refuse any bad URL before loading the first server
        targets = [make_target(url, args) for url in args.url]
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    by_round = None
    if args.rounds == 1:
        runs_by_label = {label: run_target(target, args, label) for label, target in zip(labels, targets)}
    else:
        runs_by_label, by_round = run_rounds(args, labels, targets)
    docs = [result_doc(args, target, runs_by_label[label]) for label, target in zip(labels, targets)]
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
    if by_round is not None:
        doc["by_round"] = by_round
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown_report(labels, docs) + (rounds_table(labels, by_round) if by_round else ""))
        doc["markdown"] = str(args.markdown)
    if args.plot is not None:
        doc["plots"] = [str(x) for x in write_plots(args.plot, runs_by_label, f"{args.workload}, {args.api}")]
    emit(doc, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

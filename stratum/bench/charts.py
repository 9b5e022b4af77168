"""PNG charts of `stratum bench serve` and `compare` runs (matplotlib, files only): TTFT CDFs, and
throughput against concurrency.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, title: str, path: Path) -> Path:
    """The finish every chart shares: grid, title, legend, written as a PNG."""
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_cdf(series: dict[str, Iterable[float]], path: Path, title: str = "TTFT CDF") -> Path:
    """One empirical CDF line per label; values in seconds, plotted in ms."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in series.items():
        ms = sorted(1000 * v for v in values)
        if ms:
            ax.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post", label=label)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    return _save(plt, fig, ax, title, path)


def plot_throughput(series: dict[str, list[tuple[int, float | None]]], path: Path,
                    title: str = "Throughput vs concurrency") -> Path:
    """Output tokens/s against concurrency, one line per label."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in series.items():
        xs = [c for c, v in points if v is not None]
        ax.plot(xs, [v for _, v in points if v is not None], marker="o", label=label)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({c for points in series.values() for c, _ in points}))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())  # no 2^k labels between the levels
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    return _save(plt, fig, ax, title, path)

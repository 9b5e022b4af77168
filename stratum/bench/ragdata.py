"""`stratum bench rag`'s pure parts: a deterministic corpus from the standard library's docstrings, the
questions asked of it, the in-memory vector index (cosine, top k), the prompt, and the report's figures.
Nothing here touches the network (stratum.bench.rag does).
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from stratum.bench.serve import latency_stats

# Folders of the standard library left out of the corpus: tests, demos and vendored trees (their
# docstrings are fixtures, not documentation)
SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo",
                          "ensurepip", "pydoc_data", "__pycache__", "tkinter", "venv"})
MAX_WORD_CHARS = 60  # longer "words" are URLs and drawings: left out, so every passage keeps to its bounds
_RUNS = re.compile(r"[A-Za-z]+|[0-9]+|[^\sA-Za-z0-9]")
SYSTEM_PROMPT = "Answer the question using only the numbered passages. Be brief."


class Chunk(NamedTuple):
    text: str
    names: tuple[str, ...]  # the documented objects whose docstrings it holds (module.qualname)
    num_words: int


class Question(NamedTuple):
    text: str
    source: int  # the chunk it was written from


# ---- the corpus ----------------------------------------------------------------------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """The library's .py files in a fixed order (their paths relative to root, sorted)."""
    files = [p for p in root.rglob("*.py") if not SKIPPED_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def docstrings(path: Path, module: str) -> Iterator[tuple[str, str]]:
    """(module.qualname, docstring) for the module, then each class and function in source order; a
    file that does not parse yields nothing."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child)
                if doc:
                    yield name, doc
                yield from walk(child, name)

    doc = ast.get_docstring(tree)
    if doc:
        yield module, doc
    yield from walk(tree, module)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def estimated_pieces(word: str) -> int:
    """About how many word pieces a BERT tokenizer makes of word, rather more than fewer: each mark one,
    each run of letters one per 4 letters, of digits one per 3 (against all-MiniLM-L6-v2's tokenizer,
    the default corpus's 2,000 passages of at most 180 estimated pieces came to at most 195 real ones)."""
    n = 0
    for run in _RUNS.findall(word):
        n += -(-len(run) // 4) if run[0].isalpha() else -(-len(run) // 3) if run[0].isdigit() else 1
    return n


class _Packer:
    """Packs words into passages of min_words..max_words words, at most max_chars characters and
    max_pieces estimated word pieces (`estimated_pieces`)."""

    def __init__(self, min_words: int, max_words: int, max_chars: int, max_pieces: int):
        self.min_words, self.max_words, self.max_chars, self.max_pieces = min_words, max_words, max_chars, max_pieces
        self.chunks: list[Chunk] = []
        self._words: list[str] = []
        self._names: list[str] = []
        self._chars = 0
        self._pieces = 0

    def add(self, name: str, body: list[str]) -> None:
        """One docstring: its name as a header, then its words; a passage that fills up continues in
        the next, which repeats the header."""
        self._start(name)
        for w in body:
            if len(w) > MAX_WORD_CHARS:
                continue
            pieces = estimated_pieces(w)
            if (len(self._words) >= self.max_words or self._chars + 1 + len(w) > self.max_chars
                    or self._pieces + pieces > self.max_pieces):
                self.flush()
                self._start(name)
            self._words.append(w)
            self._chars += 1 + len(w)
            self._pieces += pieces

    def _start(self, name: str) -> None:
        header = f"{name}:"
        pieces = estimated_pieces(header)
        if (len(self._words) + 1 >= self.max_words or self._chars + len(header) + 40 > self.max_chars
                or self._pieces + pieces + 10 > self.max_pieces):
            self.flush()  # no room left for the header and a few words
        self._words.append(header)
        self._names.append(name)
        self._chars += 1 + len(header)
        self._pieces += pieces

    def flush(self) -> None:
        """End the passage; one shorter than min_words (a module's short remainder) is dropped."""
        if len(self._words) >= self.min_words:
            self.chunks.append(Chunk(" ".join(self._words), tuple(self._names), len(self._words)))
        self._words, self._names, self._chars, self._pieces = [], [], 0, 0


def build_corpus(num_chunks: int, min_words: int = 50, max_words: int = 100, max_chars: int = 640,
                 max_pieces: int = 180, root: Path | None = None) -> list[Chunk]:
    """num_chunks passages of min_words..max_words words, at most max_chars characters and max_pieces
    estimated word pieces (~100-200 tokens of a BPE vocabulary, within the 256 word pieces an all-MiniLM
    encoder reads: Stratum refuses a longer input, as OpenAI does), each the docstrings of
    consecutive objects of one module, "name: text" one after the other. The same library gives the same
    corpus.

    Raises:
        ValueError: the library holds fewer passages than asked for, or the bounds are not 0 < min <= max.
    """
    if not 0 < min_words <= max_words or max_chars < 8 * min_words:
        raise ValueError(f"need 0 < min_words <= max_words and max_chars >= 8 * min_words, got {min_words}, "
                         f"{max_words}, {max_chars}")
    root = root or stdlib_root()
    packer = _Packer(min_words, max_words, max_chars, max_pieces)
    for path in source_files(root):
        module = _module_name(path, root)
        for name, doc in docstrings(path, module):
            packer.add(name, doc.split())
            if len(packer.chunks) >= num_chunks:
                return packer.chunks[:num_chunks]
        packer.flush()  # a passage holds one module's text only
    raise ValueError(f"the library at {root} gives {len(packer.chunks)} passages of {min_words}-{max_words} words, "
                     f"fewer than {num_chunks}")


def corpus_digest(chunks: Sequence[Chunk]) -> str:
    """SHA-256 of the passages' text: two runs compare only where it is the same."""
    h = hashlib.sha256()
    for c in chunks:
        h.update(c.text.encode())
        h.update(b"\0")
    return h.hexdigest()


def make_questions(chunks: Sequence[Chunk], n: int, seed: int) -> list[Question]:
    """n questions, each about one object documented in a distinct passage (drawn with the seed), so
    the retrieval of its source can be checked. Raises ValueError when n exceeds the passages."""
    if n > len(chunks):
        raise ValueError(f"{n} questions need at least as many passages, not {len(chunks)}")
    rng = random.Random(seed)
    out = []
    for i in rng.sample(range(len(chunks)), n):
        name = rng.choice(chunks[i].names)
        module, _, obj = name.rpartition(".")
        text = (f"What does {obj} in the {module} module do, and how is it used?" if module
                else f"What is the {name} module for?")
        out.append(Question(text, i))
    return out


# ---- retrieval -----------------------------------------------------------------------------------
class VectorIndex:
    """The passages' embeddings, L2-normalized in one float32 matrix: the dot product is the cosine."""

    def __init__(self, vectors: Sequence[Sequence[float]]):
        m = np.asarray(vectors, dtype=np.float32)
        if m.ndim != 2 or not len(m):
            raise ValueError(f"need a non-empty 2-D list of vectors, got shape {m.shape}")
        self.matrix = m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12)  # [N, D]

    def top_k(self, query: Sequence[float], k: int) -> list[int]:
        """The k passages most similar to query, best first; equal scores in passage order.

        Raises:
            ValueError: the query's dimension differs from the passages'.
        """
        q = np.asarray(query, dtype=np.float32)
        if q.shape != (self.matrix.shape[1],):
            raise ValueError(f"query has shape {q.shape}, passages {self.matrix.shape[1]} dimensions")
        scores = self.matrix @ (q / max(float(np.linalg.norm(q)), 1e-12))  # [N]
        k = min(k, len(scores))
        return [int(i) for i in np.lexsort((np.arange(len(scores)), -scores))[:k]]


def build_messages(question: str, passages: Sequence[str]) -> list[dict[str, str]]:
    """The chat request's messages: the numbered passages, then the question."""
    context = "\n\n".join(f"[{i + 1}] {p}" for i, p in enumerate(passages))
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Passages:\n\n{context}\n\nQuestion: {question}"}]


# ---- what is reported ----------------------------------------------------------------------------
@dataclass(slots=True)
class QuestionResult:
    """One question's path; times in seconds from the question's start."""

    index: int
    is_ok: bool = False
    error: str | None = None
    stage: str | None = None  # where it failed: "embed", "retrieve" or "generate"
    embed_s: float | None = None
    retrieve_s: float | None = None
    ttft_s: float | None = None  # from the chat request's send to its first content
    generate_s: float | None = None  # from the first content to the last
    e2e_s: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    retrieved: list[int] = field(default_factory=list)
    is_source_retrieved: bool = False


def phase_summary(results: Sequence[QuestionResult], wall_s: float, num_planned: int) -> dict[str, Any]:
    """A phase's figures: counts, questions/s (completed / wall), latency stats in ms of the whole
    question and of each part, the share whose source passage was retrieved, and error samples."""
    ok = [r for r in results if r.is_ok]
    failed = [r for r in results if not r.is_ok]
    samples: list[str] = []
    for r in failed:
        text = f"{r.stage}: {r.error}"
        if text not in samples and len(samples) < 5:
            samples.append(text)

    def stats(attr: str) -> dict[str, float | None]:
        return latency_stats([v for r in ok if (v := getattr(r, attr)) is not None])

    return {
        "questions": num_planned, "completed": len(ok), "errors": num_planned - len(ok),
        "error_samples": samples, "wall_s": round(wall_s, 3),
        "questions_per_s": round(len(ok) / wall_s, 4) if wall_s > 0 and ok else None,
        "e2e_ms": stats("e2e_s"), "embed_ms": stats("embed_s"), "retrieve_ms": stats("retrieve_s"),
        "ttft_ms": stats("ttft_s"), "generate_ms": stats("generate_s"),
        "prompt_tokens_mean": round(sum(r.num_prompt_tokens for r in ok) / len(ok), 1) if ok else None,
        "output_tokens": sum(r.num_output_tokens for r in ok),
        "source_retrieved": round(sum(r.is_source_retrieved for r in ok) / len(ok), 4) if ok else None,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def compare_stacks(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """ours ÷ theirs for each phase's latency (p50, p99 and the parts' p50), throughput and peak memory."""
    out: dict[str, Any] = {"peak_rss": ratio((ours.get("memory") or {}).get("peak_mb"),
                                             (theirs.get("memory") or {}).get("peak_mb"))}
    for phase in ("questions", "long"):
        a, b = ours.get(phase), theirs.get(phase)
        if not a or not b:
            continue
        row = {f"e2e_{q}": ratio(a["e2e_ms"][q], b["e2e_ms"][q]) for q in ("p50", "p99")}
        row |= {f"{part}_p50": ratio(a[f"{part}_ms"]["p50"], b[f"{part}_ms"]["p50"])
                for part in ("embed", "ttft", "generate")}
        row["questions_per_s"] = ratio(a["questions_per_s"], b["questions_per_s"])
        out[phase] = row
    return out


def goal_verdict(ours: dict[str, Any], theirs: dict[str, Any], p99_ratio: float = 0.7,
                 throughput_slack: float = 0.97) -> dict[str, Any]:
    """The goal: our e2e p99 at most p99_ratio × theirs while our throughput is at least theirs (within
    throughput_slack, the run-to-run noise), and the long-context case served with no error."""
    a, b = ours.get("questions") or {}, theirs.get("questions") or {}
    p99 = ratio((a.get("e2e_ms") or {}).get("p99"), (b.get("e2e_ms") or {}).get("p99"))
    tput = ratio(a.get("questions_per_s"), b.get("questions_per_s"))
    long = ours.get("long") or {}
    is_long_ok = bool(long) and long.get("errors") == 0 and long.get("completed", 0) > 0
    is_met = (p99 is not None and tput is not None and p99 <= p99_ratio and tput >= throughput_slack
              and is_long_ok and not a.get("errors"))
    return {"p99_ratio": p99, "p99_goal": p99_ratio, "throughput_ratio": tput,
            "throughput_at_least": throughput_slack, "long_context_served": is_long_ok, "met": is_met}


def retrieval_agreement(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """The mean share of the top-k passages two stacks both retrieved for the same question (1: the
    same passages; their encoders agree)."""
    ra, rb = (a.get("questions") or {}).get("retrieved"), (b.get("questions") or {}).get("retrieved")
    pairs = [(x, y) for x, y in zip(ra or [], rb or []) if x and y]
    if not pairs:
        return None
    return round(sum(len(set(x) & set(y)) / len(x) for x, y in pairs) / len(pairs), 4)


def table(results: dict[str, dict], ratios: dict[str, Any]) -> str:
    """A short table per stack: the two cases' latency, parts, throughput, errors; then memory and ratios."""
    lines = [f"{'stack':<14} {'case':<9} {'ok':>7} {'q/s':>7} {'e2e p50':>9} {'e2e p99':>9} {'embed p50':>9} "
             f"{'TTFT p50':>9} {'gen p50':>9} {'peak RSS':>10}"]

    def ms(d: dict | None, key: str) -> str:
        v = (d or {}).get(key)
        return f"{v:,.0f}" if v is not None else "-"

    for label, doc in results.items():
        if "error" in doc:
            lines.append(f"{label:<14} not run: {doc['error']}")
            continue
        peak = (doc.get("memory") or {}).get("peak_mb")
        for phase in ("questions", "long"):
            s = doc.get(phase)
            if not s:
                continue
            lines.append(f"{label:<14} {phase:<9} {s['completed']:>3}/{s['questions']:<3} "
                         f"{s.get('questions_per_s') or '-':>7} {ms(s.get('e2e_ms'), 'p50'):>9} "
                         f"{ms(s.get('e2e_ms'), 'p99'):>9} {ms(s.get('embed_ms'), 'p50'):>9} "
                         f"{ms(s.get('ttft_ms'), 'p50'):>9} {ms(s.get('generate_ms'), 'p50'):>9} "
                         f"{f'{peak:,.0f} MB' if peak else '-':>10}")
            if s["error_samples"]:
                lines.append(f"{'':<14} errors: {s['error_samples'][0][:150]}")
    for key, row in ratios.items():
        lines.append(f"{key}: " + ", ".join(f"{k} {v}" for k, v in _flat(row)))
    return "\n".join(lines)


def _flat(row: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in row.items():
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append((prefix + k, v))
    return out

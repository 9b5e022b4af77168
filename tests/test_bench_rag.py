"""`stratum bench rag`'s pure parts: the corpus (deterministic, within its bounds), the questions, top-k
retrieval by cosine, the report's percentiles and ratios, the goal, and the command line. No network."""

from __future__ import annotations

import pytest

from stratum.bench import rag
from stratum.bench.ragdata import (
    Chunk, QuestionResult, VectorIndex, build_corpus, build_messages, compare_stacks, corpus_digest, estimated_pieces,
    goal_verdict, make_questions, phase_summary, retrieval_agreement, table,
)


def write_library(root):
    """A small library: two modules, a package and a test folder that must be left out."""
    (root / "pkg").mkdir()
    (root / "test").mkdir()
    words = " ".join(f"w{i}" for i in range(30))
    (root / "alpha.py").write_text(f'"""Alpha module. {words}"""\n\ndef f():\n    """Eff does {words}."""\n\n'
                                   f'class K:\n    """Kay keeps {words}."""\n\n    def m(self):\n'
                                   f'        """Em of kay, {words}."""\n')
    (root / "pkg" / "__init__.py").write_text(f'"""The package. {words} {words} {words}"""\n')
    (root / "test" / "test_x.py").write_text(f'"""A fixture. {words} {words}"""\n')
    (root / "broken.py").write_text("def (:\n")


# ---- the corpus ----------------------------------------------------------------------------------
def test_corpus_packs_docstrings_in_source_order_within_the_bounds(tmp_path):
    write_library(tmp_path)
    chunks = build_corpus(3, min_words=40, max_words=70, max_chars=10_000, max_pieces=10_000, root=tmp_path)
    # alpha's module (33 words with its header) and f (33) make 66; K's header and 3 words fill the 70, and
    # K goes on in the next passage under its header again, with K.m (64 at the module's end)
    assert [c.names for c in chunks] == [("alpha", "alpha.f", "alpha.K"), ("alpha.K", "alpha.K.m"), ("pkg",)]
    assert [c.num_words for c in chunks] == [70, 64, 70]
    assert chunks[0].text.endswith("alpha.K: Kay keeps w0") and chunks[1].text.startswith("alpha.K: w1 w2")
    assert chunks[0].text.startswith("alpha: Alpha module. w0 w1")
    assert "alpha.f: Eff does w0" in chunks[0].text
    assert all(40 <= c.num_words <= 70 and c.num_words == len(c.text.split()) for c in chunks)
    assert not any("fixture" in c.text for c in chunks)  # the test folder is left out
    # the package's 93 words: a passage of 70, then a remainder of 24 under 40, dropped


def test_corpus_too_small_or_bad_bounds_is_an_error(tmp_path):
    write_library(tmp_path)
    with pytest.raises(ValueError, match="fewer than 100"):
        build_corpus(100, min_words=40, max_words=70, max_chars=10_000, max_pieces=10_000, root=tmp_path)
    with pytest.raises(ValueError):
        build_corpus(3, min_words=80, max_words=70, root=tmp_path)


def test_estimated_pieces_count_marks_and_runs():
    assert estimated_pieces("cat") == 1
    assert estimated_pieces("tokenizer") == 3  # 9 letters: one piece per 4
    assert estimated_pieces("os.path.join()") == 7  # os . path . join ( ): seven runs of one piece each
    assert estimated_pieces("0x1f2e3d") == 8  # digits and letters alternate: eight runs
    assert estimated_pieces("1234567") == 3  # seven digits: one piece per 3


def test_stdlib_corpus_is_deterministic_and_bounded():
    a, b = build_corpus(300), build_corpus(300)
    assert a == b and corpus_digest(a) == corpus_digest(b)
    assert len(a) == 300 and len({c.text for c in a}) == 300
    assert all(50 <= c.num_words <= 100 and len(c.text) <= 640 for c in a)
    assert all(sum(map(estimated_pieces, c.text.split())) <= 180 for c in a)
    assert corpus_digest(a[:299]) != corpus_digest(a)


def test_questions_are_seeded_and_name_their_passage():
    chunks = build_corpus(50)
    q1, q2 = make_questions(chunks, 10, seed=3), make_questions(chunks, 10, seed=3)
    assert q1 == q2 and q1 != make_questions(chunks, 10, seed=4)
    assert len({q.source for q in q1}) == 10
    for q in q1:
        assert any(name.rpartition(".")[2] in q.text for name in chunks[q.source].names)
    with pytest.raises(ValueError):
        make_questions(chunks, 51, seed=0)


# ---- retrieval -----------------------------------------------------------------------------------
def test_top_k_is_by_cosine_best_first_ties_in_passage_order():
    index = VectorIndex([[1, 0, 0], [10, 10, 0], [0, 1, 0], [0, 0, 1], [2, 2, 0]])
    # cosine to [1, 1, 0]: rows 1 and 4 (1.0, a tie kept in passage order), then 0 and 2 (0.707), then 3
    assert index.top_k([1, 1, 0], 5) == [1, 4, 0, 2, 3]
    assert index.top_k([3, 3, 0], 2) == [1, 4]  # the query's length does not matter
    assert index.top_k([0, 0, -1], 1) == [0]  # row 3 is the least similar (-1); 0, 1, 2, 4 tie at 0
    assert index.top_k([1, 0, 0], 99) == [0, 1, 4, 2, 3]  # k past the passages: all of them
    with pytest.raises(ValueError):
        index.top_k([1, 0], 2)
    with pytest.raises(ValueError):
        VectorIndex([])


def test_messages_number_the_passages():
    msgs = build_messages("Why?", ["first", "second"])
    assert msgs[0]["role"] == "system"
    assert msgs[1]["content"] == "Passages:\n\n[1] first\n\n[2] second\n\nQuestion: Why?"


# ---- the report ----------------------------------------------------------------------------------
def ok_result(i: int, e2e: float, ttft: float, *, source: bool = True) -> QuestionResult:
    return QuestionResult(i, is_ok=True, embed_s=0.01, retrieve_s=0.001, ttft_s=ttft, generate_s=e2e - ttft - 0.011,
                          e2e_s=e2e, num_prompt_tokens=1000 + i, num_output_tokens=64, is_source_retrieved=source)


def test_phase_summary_percentiles_throughput_and_errors():
    results = [ok_result(i, 1.0 + i, 0.5, source=i % 2 == 0) for i in range(5)]
    results.append(QuestionResult(5, error="HTTP 404: no route", stage="embed"))
    s = phase_summary(results, wall_s=10.0, num_planned=6)
    assert (s["completed"], s["errors"]) == (5, 1)
    assert s["error_samples"] == ["embed: HTTP 404: no route"]
    assert s["questions_per_s"] == 0.5
    # e2e 1..5 s: p50 3 s; p99 interpolated 4 + 0.96 s (numpy's linear rule)
    assert s["e2e_ms"]["p50"] == 3000.0 and s["e2e_ms"]["p99"] == pytest.approx(4960.0)
    assert s["ttft_ms"]["p99"] == 500.0 and s["embed_ms"]["p50"] == 10.0
    assert s["prompt_tokens_mean"] == 1002.0 and s["output_tokens"] == 320
    assert s["source_retrieved"] == 0.6


def test_phase_summary_of_only_failures():
    s = phase_summary([QuestionResult(0, error="x", stage="generate")], wall_s=1.0, num_planned=1)
    assert s["questions_per_s"] is None and s["e2e_ms"]["p99"] is None and s["errors"] == 1


def stack_doc(p99_s: float, qps: float, long_errors: int = 0) -> dict:
    q = phase_summary([ok_result(0, p99_s, 0.2)], wall_s=1 / qps, num_planned=1)
    long = phase_summary([ok_result(0, 30.0, 25.0)] if not long_errors else [QuestionResult(0, error="ctx")],
                         wall_s=30.0, num_planned=1)
    return {"questions": q, "long": long, "memory": {"peak_mb": 1000.0 * p99_s}}


def test_ratios_and_goal():
    ours, theirs = stack_doc(1.0, 2.0), stack_doc(2.0, 2.0)
    r = compare_stacks(ours, theirs)
    assert r["questions"]["e2e_p99"] == 0.5 and r["questions"]["questions_per_s"] == 1.0
    assert r["peak_rss"] == 0.5 and r["long"]["e2e_p50"] == 1.0
    assert goal_verdict(ours, theirs)["met"]
    assert not goal_verdict(stack_doc(1.5, 2.0), theirs)["met"]  # p99 0.75x
    assert not goal_verdict(stack_doc(1.0, 1.0), theirs)["met"]  # half the throughput
    verdict = goal_verdict(stack_doc(1.0, 2.0, long_errors=1), theirs)
    assert not verdict["long_context_served"] and not verdict["met"]
    assert goal_verdict({"questions": {"errors": 4}}, theirs)["p99_ratio"] is None


def test_retrieval_agreement():
    a = {"questions": {"retrieved": [[1, 2, 3, 4], [5, 6, 7, 8]]}}
    b = {"questions": {"retrieved": [[4, 3, 2, 1], [5, 6, 0, 9]]}}
    assert retrieval_agreement(a, b) == 0.75
    assert retrieval_agreement(a, {"questions": {"completed": 0}}) is None


# ---- the command line ----------------------------------------------------------------------------
def test_given_stacks():
    one = rag.given_stack("stratum=http://127.0.0.1:8080/v1", allow_remote=False)
    assert (one.embed_url, one.chat_url) == ("http://127.0.0.1:8080", "http://127.0.0.1:8080")
    two = rag.given_stack("pair=http://127.0.0.1:1,http://localhost:2", allow_remote=False)
    assert (two.label, two.embed_url, two.chat_url) == ("pair", "http://127.0.0.1:1", "http://localhost:2")
    for bad in ("http://127.0.0.1:1", "x=a,b,c", "=http://127.0.0.1:1"):
        with pytest.raises(ValueError):
            rag.given_stack(bad, allow_remote=False)
    with pytest.raises(rag.BenchError):
        rag.given_stack("far=http://example.com:80", allow_remote=False)


def test_arguments():
    assert rag.parse_args([]).start == ["stratum"]
    assert rag.parse_args(["--llama-server", "/bin/true"]).start == ["stratum", "llama"]
    assert rag.parse_args(["--start", "", "--url", "a=http://127.0.0.1:1"]).start == []
    for bad in (["--start", "llama"], ["--start", "vllm"], ["--concurrency", "0"], ["--rate", "-1"]):
        with pytest.raises(SystemExit):
            rag.parse_args(bad)


def test_table_reports_a_stack_that_could_not_run():
    done = stack_doc(1.0, 2.0)
    text = table({"stratum": {"error": "exited (1)"}, "llama-server": done}, {})
    assert "stratum        not run: exited (1)" in text
    assert "llama-server   questions" in text and "llama-server   long" in text


def test_chunk_is_plain_data():
    assert Chunk("a b", ("m",), 2)._asdict() == {"text": "a b", "names": ("m",), "num_words": 2}

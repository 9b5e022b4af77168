"""Incremental detokenization: no split or repeated UTF-8 character, and no leaked stop string.

The tiny model's byte-level BPE knows few CJK characters and no emoji, so those arrive as single
bytes spread over several tokens: the hard case for streaming.
"""

from __future__ import annotations

import pytest

from stratum.engine.config import SchedulerConfig
from stratum.engine.detokenizer import Detokenizer, StopStrings
from stratum.engine import LLM
from stratum.models.loader import load_checkpoint
from stratum.engine.sampling_params import SamplingParams

CAPITALS = "The capital of Japan is Tokyo. The capital of Germany is Berlin."
MULTIBYTE_TEXTS = [
    "東京は首都、中文很难。",
    "Emoji 🎉🙂 and 🚀 with 한국어",
    "naïve Straße — ελληνικά 東京 🙂!",
    "The capital of Japan is Tokyo. 🚀🚀🚀 done",
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_checkpoint(tiny_model_dir).tokenizer


def stream(tok, ids: list[int], stop: list[str] | None = None) -> tuple[StopStrings, list[str]]:
    """Feed ids one at a time as the engine does (decoded text into the stop strings); returns the
    answer's text and every delta released.

    Asserts after each token that everything released so far is a prefix of the final text.
    """
    detok, answer = Detokenizer(tok), StopStrings(list(stop or []))
    deltas = []
    for token in ids:
        answer.add(detok.add(token))
        finished = answer.stop_hit is not None
        deltas.append(answer.take_delta(finished))
        released = "".join(deltas)
        assert answer.text.startswith(released)
        if finished:
            break
    else:
        answer.add(detok.flush())
        deltas.append(answer.take_delta(True))
    return answer, deltas


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_incremental_decode_never_splits_or_repeats_a_character(tok, text):
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the text should contain characters split across tokens"
    detok, deltas = stream(tok, ids)
    assert "".join(deltas) == text == tok.decode(ids) == detok.text
    assert not any("\ufffd" in d for d in deltas)


def test_a_partial_character_is_held_until_its_last_byte(tok):
    ids = tok.encode("🚀")
    assert len(ids) > 1
    detok = Detokenizer(tok)
    for token in ids[:-1]:
        assert detok.add(token) == ""
    assert detok.add(ids[-1]) == "🚀"


def test_special_tokens_are_skipped_without_breaking_the_stream(tok):
    end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("Hello 🙂") + [end] + tok.encode(" world")
    detok, deltas = stream(tok, ids)
    assert "".join(deltas) == "Hello 🙂 world"


@pytest.mark.parametrize(("text", "stop", "expected"), [
    (CAPITALS, ["Tokyo."], "The capital of Japan is "),
    (CAPITALS, ["Berlin", "of Japan"], "The capital "),
    (CAPITALS, ["apital of G"], "The capital of Japan is Tokyo. The c"),
    ("naïve Straße — ελληνικά 東京 🙂!", ["京 🙂"], "naïve Straße — ελληνικά 東"),
    ("Emoji 🎉🙂 and 🚀 with 한국어", ["🙂"], "Emoji 🎉"),
    ("Emoji 🎉🙂 and 🚀 with 한국어", ["d"], "Emoji 🎉🙂 an"),
])
def test_a_stop_string_split_across_tokens_is_never_leaked(tok, text, stop, expected):
    ids = tok.encode(text)
    detok, deltas = stream(tok, ids, stop)
    assert detok.stop_hit in stop
    assert detok.text == expected
    assert "".join(deltas) == expected
    for s in stop:
        assert s not in "".join(deltas)


def test_every_stop_in_the_cases_above_spans_several_tokens(tok):
    """Guard for the test above: the stops really are split, so the hold-back is exercised."""
    for text, stop in ((CAPITALS, "apital of G"), ("naïve Straße — ελληνικά 東京 🙂!", "京 🙂")):
        ids = tok.encode(text)
        pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
        start = text.index(stop)
        # some token boundary falls strictly inside the stop string
        assert any(start < len(p) < start + len(stop) for p in pieces if "\ufffd" not in p)


def test_text_is_held_back_only_while_a_stop_could_still_complete(tok):
    detok, answer = Detokenizer(tok), StopStrings(["XYZ"])
    released = ""
    for token in tok.encode("The capital of Japan"):
        answer.add(detok.add(token))
        released += answer.take_delta(False)
        assert len(answer.text) - len(released) <= 2  # at most len("XYZ") - 1 characters held
    answer.add(detok.flush())
    released += answer.take_delta(True)
    assert released == "The capital of Japan" and answer.stop_hit is None


# ---- through the engine ----------------------------------------------------------------------------


def engine_stream(llm: LLM, prompt: list[int], sampling: SamplingParams):
    engine = llm.engine
    engine.add_request(prompt, sampling, request_id="detok")
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.delta_text)
            if out.finished:
                final = out
    return deltas, final


def test_engine_stream_concatenates_to_the_final_text_and_cuts_at_the_stop(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=16, dtype="float32", device="cpu", num_threads=1,
              scheduler=SchedulerConfig(max_num_batched_tokens=64))
    tok = llm.engine.tokenizer
    prompt = tok.encode("Once upon a time there was")
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, skip_special_tokens=True)
    deltas, full = engine_stream(llm, prompt, greedy)
    assert "".join(deltas) == full.text == tok.decode(full.token_ids)
    assert len(full.text) > 12

    # a stop string that starts inside one token and ends inside a later one
    pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    bounds = sorted({len(p) for p in pieces if "\ufffd" not in p})
    cut = next(b for b in bounds if 4 <= b < len(full.text) - 4)
    stop = full.text[cut - 2 : cut + 3]
    expected = full.text[: full.text.index(stop)]
    deltas, out = engine_stream(llm, prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                            stop=[stop]))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == expected == "".join(deltas)
    assert all(stop not in "".join(deltas[: i + 1]) for i in range(len(deltas)))


@pytest.fixture(scope="module")
def real_tok(real_model_path):
    from gguf import GGUFReader

    from stratum.models.loader import read_gguf_metadata
    from stratum.models.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(read_gguf_metadata(GGUFReader(str(real_model_path))))


@pytest.mark.integration
@pytest.mark.parametrize("text", [*MULTIBYTE_TEXTS, "日本の首都は東京です。 Emoji: 🙂🚀 — naïve café, Straße, 中文"])
def test_real_tokenizer_stream_is_exact(real_tok, text):
    ids = real_tok.encode(text)
    detok, deltas = stream(real_tok, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    detok, deltas = stream(real_tok, ids, [stop])
    assert "".join(deltas) == text[: text.index(stop)]

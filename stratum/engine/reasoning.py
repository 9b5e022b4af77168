"""Reasoning: a model's thought told from its answer as its text streams, and its budget held.

A family that reasons writes its thought between two markers (`<think>` and `</think>` for Qwen3 and
DeepSeek-R1's distills), and the prompt may have opened it already (a template whose generation
prompt ends with the start marker). `ThoughtSplitter` reads the output text as it is decoded and
releases thought and answer apart, holding back what could still become a marker; the output
processor counts the thought's tokens, and once a request's budget is spent the engine writes the end
marker itself (`Reasoning.end_token_ids`), so the model goes on to its answer.

    output text:  <think>\\nLet me see...\\n</think>\\n\\nParis.
    thought:      "Let me see..."          (the markers and the newlines around them dropped)
    answer:       "Paris."
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Reasoning:
    """How one request's output reasons (`AddRequest.reasoning`; None: it does not).

    start, end: the thought's markers as text. is_open: the prompt already opened the thought.
    budget: thought tokens before the engine ends it (None: as many as max_tokens allows).
    end_token_ids: what the engine writes to end a thought at its budget (the end marker, with the
    newlines the family's template writes around it).
    """

    start: str
    end: str
    is_open: bool = False
    budget: int | None = None
    end_token_ids: list[int] = field(default_factory=list)
    # markers the vocabulary holds as special tokens (decoding skips those): id -> the marker's text
    marker_token_ids: dict[int, str] = field(default_factory=dict)


class Phase(enum.Enum):
    BEFORE = "before"  # nothing but whitespace yet: a thought may still begin
    THINKING = "thinking"
    ANSWER = "answer"


class ThoughtSplitter:
    """Output text in, thought and answer out (`feed` -> (thought, answer) released now).

    Held back: in BEFORE, the text while it could still become the start marker; while THINKING, the
    end of the thought that could be the start of the end marker, and its trailing newlines (dropped
    if the marker follows). The newlines right after either marker are dropped.
    """

    def __init__(self, start: str, end: str, is_open: bool = False):
        self.start, self.end = start, end
        self.phase = Phase.THINKING if is_open else Phase.BEFORE
        self._held = ""
        self._at_thought_start = is_open  # the newlines after the start marker are not the thought's
        self._at_answer_start = False  # nor those after the end marker the answer's

    def feed(self, text: str) -> tuple[str, str]:
        thought = answer = ""
        text = self._held + text
        self._held = ""
        if self.phase is Phase.BEFORE:
            stripped = text.lstrip()
            if stripped.startswith(self.start):
                self.phase, self._at_thought_start = Phase.THINKING, True
                text = stripped[len(self.start):]
            elif self.start.startswith(stripped):
                self._held = text
                return "", ""
            else:
                self.phase = Phase.ANSWER
        if self.phase is Phase.THINKING:
            if self._at_thought_start:
                text = text.lstrip("\n")
                self._at_thought_start = not text
            i = text.find(self.end)
            if i < 0:
                keep = _held_tail(text, self.end)
                self._held = text[len(text) - keep:]
                return text[: len(text) - keep], ""
            thought, text = text[:i].rstrip("\n"), text[i + len(self.end):]
            self.phase, self._at_answer_start = Phase.ANSWER, True
        if self._at_answer_start:
            text = text.lstrip("\n")
            self._at_answer_start = not text
        return thought, answer + text

    def flush(self) -> tuple[str, str]:
        """The output ended: what is held goes where it stands (an unclosed thought stays thought)."""
        held, self._held = self._held, ""
        if self.phase is Phase.THINKING:
            return held.rstrip("\n"), ""
        return "", held


def _held_tail(text: str, end: str) -> int:
    """How many trailing characters of a thought's text to hold: the longest suffix that begins the
    end marker, and the newlines before it (a thought's last newlines are dropped when the marker
    follows them)."""
    keep = 0
    for n in range(min(len(end) - 1, len(text)), 0, -1):
        if end.startswith(text[-n:]):
            keep = n
            break
    body = text[: len(text) - keep]
    return keep + len(body) - len(body.rstrip("\n"))

"""Incremental text: decoding that never splits a UTF-8 character and never repeats one (`Detokenizer`),
and stop strings matched on the answer as it grows, never leaked (`StopStrings`).

Byte-level BPE tokens can end in the middle of a multi-byte character. Text is released only up
to the last complete character (the pending tail decodes to U+FFFD until its bytes arrive), as in
vLLM's and TGI's prefix/read offsets. Stop strings are matched on the text, and the last
(longest stop - 1) characters are held back so a stop string split across tokens is never leaked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stratum.models.tokenizer import TextTokenizer


@dataclass(slots=True)
class Detokenizer:
    tokenizer: TextTokenizer
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def add(self, token_id: int) -> str:
        """Append one token. Returns the text it completes (empty while a character is still partial)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """At the end of a request: whatever text remains, a partial character's replacement included."""
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


@dataclass(slots=True)
class StopStrings:
    """The answer's text as it grows, cut at the first stop string (`stop_hit` then says which)."""

    stop: list[str] = field(default_factory=list)
    text: str = ""  # the answer so far, up to a stop string
    emitted: int = 0  # characters of `text` already released
    stop_hit: str | None = None

    def add(self, new: str) -> None:
        if not new or self.stop_hit is not None:
            return
        self.text += new
        if not self.stop:
            return
        longest = max(len(s) for s in self.stop)
        begin = max(0, len(self.text) - len(new) - longest + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, begin)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stop_hit = best[1]

    def take_delta(self, finished: bool) -> str:
        """New text to release. Unless finished, keeps back a possible partial stop string."""
        end = len(self.text)
        if not finished and self.stop and self.stop_hit is None:
            end = max(self.emitted, end - (max(len(s) for s in self.stop) - 1))
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

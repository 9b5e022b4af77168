"""Incremental detokenization that never splits a UTF-8 character and never repeats one.

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
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded text so far (complete characters only)
    emitted: int = 0  # characters of `text` already released
    prefix_offset: int = 0
    read_offset: int = 0
    stop_hit: str | None = None

    def add(self, token_id: int) -> None:
        """Append one token; updates `text`, and `stop_hit` if a stop string completed."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._check_stop(len(full) - len(prefix))

    def _check_stop(self, num_new: int) -> None:
        if not self.stop:
            return
        longest = max(len(s) for s in self.stop)
        begin = max(0, len(self.text) - num_new - longest + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, begin)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stop_hit = best[1]

    def flush(self) -> None:
        """At the end of a request: release whatever complete or incomplete text remains."""
        if self.stop_hit is None:
            full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset = len(self.ids)

    def take_delta(self, finished: bool) -> str:
        """New text to release. Unless finished, keeps back a possible partial stop string."""
        end = len(self.text)
        if not finished and self.stop:
            end = max(self.emitted, end - (max(len(s) for s in self.stop) - 1))
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

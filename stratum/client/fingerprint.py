"""Request-fingerprint standardisation: high-entropy spans (timestamps, UUIDs, hex ids, JWTs, ...) become stable
placeholders, so requests that differ only in them share a prefix-cache entry instead of missing it.

    "Ticket 3f2a...-9c1e opened 2025-03-01T10:22:05Z"  ->  "Ticket <UUID_1> opened <TIMESTAMP_1>"

Placeholders are numbered by first appearance within one request (the same value gets the same placeholder),
so two requests with the same shape standardise to the same text, and `restore` can put the values back
into an answer.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence


@dataclass(frozen=True, slots=True)
class FingerprintPattern:
    """A span to replace. `validate` (optional) gets the matched text and may veto the match."""

    name: str
    regex: re.Pattern[str]
    placeholder: str  # the placeholder stem: <STEM_n>
    validate: Callable[[str], bool] | None = None


def _shannon_bits(s: str) -> float:
    counts = Counter(s)
    return -sum(c / len(s) * math.log2(c / len(s)) for c in counts.values())


def _is_random_token(s: str) -> bool:
    """Mixed-case letters and digits with high per-character entropy: an API key or opaque id, not a word."""
    return (sum(ch.isdigit() for ch in s) >= 2 and any(ch.islower() for ch in s)
            and any(ch.isupper() for ch in s) and _shannon_bits(s) >= 3.5)


def _is_plausible_epoch(s: str) -> bool:
    """Seconds, ms or µs since 1970 that land between 2001-09-09 and 2033-05-18."""
    digits = s.split(".")[0]
    seconds = int(digits) / 10 ** (len(digits) - 10)
    return 1_000_000_000 <= seconds < 2_000_000_000


_NOT_ALNUM_BEFORE = r"(?<![0-9A-Za-z])"
_NOT_ALNUM_AFTER = r"(?![0-9A-Za-z])"
_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"

# Order matters: earlier patterns claim their spans first (a JWT contains hex-looking runs, an ISO
# timestamp contains digits that look like an epoch).
DEFAULT_PATTERNS: tuple[FingerprintPattern, ...] = (
    FingerprintPattern("jwt", re.compile(
        _NOT_ALNUM_BEFORE + r"eyJ[A-Za-z0-9_-]{4,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{8,}" + r"(?![A-Za-z0-9_-])"),
        "JWT"),
    FingerprintPattern("uuid", re.compile(
        _NOT_ALNUM_BEFORE + r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
        + _NOT_ALNUM_AFTER),
        "UUID"),
    FingerprintPattern("iso8601", re.compile(
        _NOT_ALNUM_BEFORE + r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d{1,9})?)?(?:\s?Z|[+-]\d{2}:?\d{2})?"
        r"|" + _NOT_ALNUM_BEFORE + r"\d{8}T\d{6}(?:\.\d{1,9})?Z?" + _NOT_ALNUM_AFTER), "TIMESTAMP"),
    FingerprintPattern("rfc2822", re.compile(
        r"(?:" + _DAY + r",\s+)?\b\d{1,2}\s+" + _MONTH + r"\s+\d{4}\s+\d{2}:\d{2}(?::\d{2})?\s+"
        r"(?:[+-]\d{4}|GMT|UTC|[ECMP][SD]T)\b"
        r"|\b" + _DAY + r"\s+" + _MONTH + r"\s+\d{1,2}\s+\d{2}:\d{2}:\d{2}(?:\s+[A-Z]{3})?\s+\d{4}\b"), "TIMESTAMP"),
    FingerprintPattern("epoch", re.compile(
        _NOT_ALNUM_BEFORE + r"1\d{9}(?:\d{3}|\d{6})?(?:\.\d{1,9})?" + r"(?![0-9A-Za-z])(?!\.\d)"), "EPOCH",
        _is_plausible_epoch),
    FingerprintPattern("hex", re.compile(
        _NOT_ALNUM_BEFORE + r"(?:0x)?(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{16,}" + _NOT_ALNUM_AFTER),
        "HEX"),
    FingerprintPattern("ulid", re.compile(_NOT_ALNUM_BEFORE + r"[0-7][0-9A-HJKMNP-TV-Z]{25}" + _NOT_ALNUM_AFTER), "ID",
                       lambda s: sum(ch.isdigit() for ch in s) >= 4 and sum(ch.isalpha() for ch in s) >= 4),
    FingerprintPattern("token", re.compile(
        r"(?<![A-Za-z0-9_+/=-])[A-Za-z0-9_+/-]{20,}={0,2}(?![A-Za-z0-9_+/=-])"), "TOKEN", _is_random_token),
)


class Fingerprinter:
    """Replaces high-entropy spans with numbered placeholders.

    Args:
        patterns: the spans to replace, in priority order; defaults to DEFAULT_PATTERNS.
        extra_patterns: (name, regex[, placeholder]) added after `patterns`; a regex may be a string.
        disable: names of patterns to leave out (e.g. {"epoch"} where 10-digit numbers are account ids).
    """

    def __init__(self, patterns: Sequence[FingerprintPattern] = DEFAULT_PATTERNS,
                 extra_patterns: Iterable[FingerprintPattern | tuple] = (), disable: Iterable[str] = ()):
        extra = [p if isinstance(p, FingerprintPattern) else _pattern(*p) for p in extra_patterns]
        off = set(disable)
        self.patterns: tuple[FingerprintPattern, ...] = tuple(p for p in (*patterns, *extra) if p.name not in off)

    def standardize_text(self, text: str, seen: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
        """Returns (standardised text, {placeholder: original}). `seen` carries numbering across the texts of
        one request (original -> placeholder) and is updated in place."""
        seen = {} if seen is None else seen
        spans: list[tuple[int, int, FingerprintPattern]] = []
        taken = bytearray(len(text))  # 1 where an earlier (higher-priority) pattern already matched
        for p in self.patterns:
            for m in p.regex.finditer(text):
                a, b = m.span()
                if a == b or any(taken[a:b]) or (p.validate is not None and not p.validate(m.group())):
                    continue
                taken[a:b] = b"\x01" * (b - a)
                spans.append((a, b, p))
        spans.sort(key=lambda s: s[0])
        out, pos = [], 0
        for a, b, p in spans:
            value = text[a:b]
            if value not in seen:
                n = sum(1 for ph in seen.values() if ph.startswith(f"<{p.placeholder}_")) + 1
                seen[value] = f"<{p.placeholder}_{n}>"
            out += [text[pos:a], seen[value]]
            pos = b
        out.append(text[pos:])
        return "".join(out), {ph: v for v, ph in seen.items()}

    def standardize(self, obj: Any, seen: dict[str, str] | None = None) -> Any:
        """Standardise a string, a list of messages / content blocks, or a request dict (its `system` and
        `messages`; other keys are kept as they are). Returns a new object; the input is not modified."""
        seen = {} if seen is None else seen
        if isinstance(obj, str):
            return self.standardize_text(obj, seen)[0]
        if isinstance(obj, Mapping):
            if "messages" in obj or "system" in obj:  # a request: only the prompt parts
                out = dict(obj)
                for key in ("system", "messages"):
                    if key in out and out[key] is not None:
                        out[key] = self.standardize(out[key], seen)
                return out
            if "content" in obj:  # a message
                return {**obj, "content": self.standardize(obj["content"], seen)}
            if obj.get("type") == "text" and isinstance(obj.get("text"), str):  # a content block
                return {**obj, "text": self.standardize_text(obj["text"], seen)[0]}
            return dict(obj)
        if isinstance(obj, (list, tuple)):
            return [self.standardize(x, seen) for x in obj]
        return obj

    def standardize_request(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """A `messages.create` keyword set with its `system` and `messages` standardised."""
        return self.standardize(dict(params))

    @staticmethod
    def restore(text: str, mapping: Mapping[str, str]) -> str:
        """Put the original values back (e.g. into an answer that repeated a placeholder)."""
        if not mapping:
            return text
        return re.sub("|".join(re.escape(ph) for ph in sorted(mapping, key=len, reverse=True)),
                      lambda m: mapping[m.group()], text)


def _pattern(name: str, regex: str | re.Pattern[str], placeholder: str | None = None) -> FingerprintPattern:
    return FingerprintPattern(name, re.compile(regex) if isinstance(regex, str) else regex, placeholder or name.upper())


def standardize_fingerprint(target: Any = None, /, *,
                            patterns: Fingerprinter | Sequence[FingerprintPattern] | None = None):
    """Standardise request fingerprints, as a function or as a decorator.

    - `standardize_fingerprint("text")`, `(messages)` or `(request_dict)`: the standardised copy.
    - `@standardize_fingerprint` or `@standardize_fingerprint(patterns=...)` on a function (sync or async):
      its `messages` and `system` keyword arguments are standardised before each call.

    Args:
        target: what to standardise, or the function to decorate.
        patterns: a Fingerprinter, or the pattern list to build one from; DEFAULT_PATTERNS when None.
    """
    fp = patterns if isinstance(patterns, Fingerprinter) else Fingerprinter(patterns or DEFAULT_PATTERNS)
    if target is None:
        return lambda fn: standardize_fingerprint(fn, patterns=fp)
    if not callable(target):
        return fp.standardize(target)

    def prepare(kwargs: dict[str, Any]) -> dict[str, Any]:
        seen: dict[str, str] = {}  # one numbering for system and messages together, as in a request
        for key in ("system", "messages"):
            if kwargs.get(key) is not None:
                kwargs[key] = fp.standardize(kwargs[key], seen)
        return kwargs

    if inspect.iscoroutinefunction(target):
        @functools.wraps(target)
        async def async_wrapper(*args, **kwargs):
            return await target(*args, **prepare(kwargs))
        return async_wrapper

    @functools.wraps(target)
    def wrapper(*args, **kwargs):
        return target(*args, **prepare(kwargs))
    return wrapper

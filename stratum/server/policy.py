"""Content policies (`--content-policy FILE`): the rules a tenant's prompts and answers must keep, loaded
and reloaded without dropping a request (`PolicyStore`), matched in linear time on normalized text
(`Matcher`: Aho-Corasick for terms, RE2 for patterns), and the screen that holds a streamed answer back
by the longest rule's reach so that no forbidden phrase reaches a client, whatever its token split
(`AnswerScreen`, one per choice and field; `OutputScreen` over a choice's engine outputs).

A policy file (JSON, or YAML when PyYAML is installed):

    {"rules": [{"id": "secrets", "action": "block", "terms": ["project aurora"]},
               {"id": "cards", "action": "mask", "pattern": "\\\\b\\\\d{4}[ -]?\\\\d{4}[ -]?\\\\d{4}[ -]?\\\\d{4}\\\\b",
                "applies_to": ["answer"], "tenants": ["key:1a2b3c4d5e6f7a8b"]}]}
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
import time
import unicodedata
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import ahocorasick
import re2

from stratum.engine.outputs import MetaState, RequestOutput

log = logging.getLogger("stratum.server")

ACTIONS = ("block", "mask")
SCOPES = ("prompt", "answer")
# An unbounded pattern (`\d+`) matches within this many normalized characters unless its rule sets `reach`.
DEFAULT_REACH = 256
MAX_REACH = 4096
RELOAD_CHECK_S = 1.0  # how often the file's mtime is looked at
_TENANT_PREFIXES = ("key:", "user:", "addr:")
# Invisible characters that are not format (Cf) characters: the combining grapheme joiner, variation selectors.
_IGNORABLE = frozenset([0x034F, 0x180B, 0x180C, 0x180D, *range(0xFE00, 0xFE10)])


_ANY_INVISIBLE = re2.compile(r"[\p{Cf}\x{034F}\x{180B}-\x{180D}\x{FE00}-\x{FE0F}]")


class PolicyError(ValueError):
    """A policy file that cannot be used: the message names the rule and what is wrong."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule: its `terms` (literal phrases) or its `pattern` (RE2), what it does and to whom."""

    id: str
    action: str  # "block" | "mask"
    terms: tuple[str, ...] = ()
    pattern: str | None = None
    applies_to: frozenset[str] = frozenset(SCOPES)
    tenants: frozenset[str] | None = None  # tenant ids (`auth.tenant_of`); None: every tenant
    replacement: str = "***"  # what a masked match becomes
    reach: int = 0  # normalized characters a match can span (the screen's hold-back)

    def is_for(self, tenant: str, scope: str) -> bool:
        return scope in self.applies_to and (self.tenants is None or tenant in self.tenants)


class Match(NamedTuple):
    start: int  # normalized text offsets, [start, end)
    end: int
    rule: Rule


# ---- normalization --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=65536)
def _fold(ch: str) -> str:
    """One character as matching reads it: invisible ones dropped, compatibility forms and case folded.
    NFKD rather than NFKC, applied per character, so that composed and decomposed accents read alike."""
    if unicodedata.category(ch) == "Cf" or ord(ch) in _IGNORABLE:
        return ""
    return unicodedata.normalize("NFKD", unicodedata.normalize("NFKD", ch).casefold())


@functools.cache
def _invisible() -> dict[int, None]:
    """str.translate's table that drops what `_fold` drops: every format (Cf) character, the ignorables."""
    import sys

    return {c: None for c in range(sys.maxunicode + 1) if c in _IGNORABLE or unicodedata.category(chr(c)) == "Cf"}


def fold(text: str) -> str:
    """`normalize`'s text without its map, at the speed of whole-string normalization (a prompt's
    screen needs no spans). The same as `normalize` but for the canonical order of stacked combining marks."""
    if text.isascii():
        return text.lower()
    folded = unicodedata.normalize("NFKD", unicodedata.normalize("NFKD", text).casefold())
    return folded.translate(_invisible()) if _ANY_INVISIBLE.search(folded) else folded  # translate is the slow part


def normalize(text: str) -> tuple[str, list[int] | None]:
    """The text as rules match it, and for each normalized character the index of the original
    character it came from (None: the identity, an ASCII text)."""
    if text.isascii():
        return text.lower(), None
    parts, source = [], []
    for i, ch in enumerate(text):
        folded = _fold(ch)
        if folded:
            parts.append(folded)
            source.extend([i] * len(folded))
    return "".join(parts), source


def _pattern_reach(pattern: str, declared: int | None) -> int:
    """The most characters a match of the pattern can span: as Python's parser measures RE2's common
    syntax; an unbounded or unparsable pattern reaches DEFAULT_REACH unless its rule declares more."""
    if declared is not None:
        return declared
    try:
        import re._parser as sre_parse  # the stdlib's own width computation

        width = sre_parse.parse(pattern).getwidth()[1]
    except Exception:  # RE2-only syntax: no width known
        return DEFAULT_REACH
    return min(width, DEFAULT_REACH)


# ---- loading ----------------------------------------------------------------------------------------
def _tenant_id(name: str) -> str:
    """A tenant as the policy names it: a tenant id as the metrics show it, or an API key itself."""
    if name.startswith(_TENANT_PREFIXES):
        return name
    return "key:" + hashlib.sha256(name.encode()).hexdigest()[:16]


def _rule(raw: Any, index: int) -> Rule:
    if not isinstance(raw, dict):
        raise PolicyError(f"rule {index}: not an object")
    rid = raw.get("id")
    if not isinstance(rid, str) or not rid:
        raise PolicyError(f"rule {index}: needs an id")
    where = f"rule {rid!r}"
    unknown = set(raw) - {"id", "action", "terms", "pattern", "applies_to", "tenants", "replacement", "reach",
                          "description"}
    if unknown:
        raise PolicyError(f"{where}: unknown fields {sorted(unknown)}")
    action = raw.get("action")
    if action not in ACTIONS:
        raise PolicyError(f"{where}: action must be one of {ACTIONS}")
    terms, pattern = raw.get("terms"), raw.get("pattern")
    if (terms is None) == (pattern is None):
        raise PolicyError(f"{where}: give either terms or a pattern")
    if terms is not None and (not isinstance(terms, list) or not all(isinstance(t, str) and t for t in terms)):
        raise PolicyError(f"{where}: terms must be a list of non-empty strings")
    applies = raw.get("applies_to", list(SCOPES))
    if not isinstance(applies, list) or not applies or not set(applies) <= set(SCOPES):
        raise PolicyError(f"{where}: applies_to must list some of {SCOPES}")
    tenants = raw.get("tenants")
    if tenants is not None and (not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants)):
        raise PolicyError(f"{where}: tenants must be a list of strings")
    declared = raw.get("reach")
    if declared is not None and (not isinstance(declared, int) or not 1 <= declared <= MAX_REACH):
        raise PolicyError(f"{where}: reach must be 1 to {MAX_REACH}")
    replacement = raw.get("replacement", "***")
    if not isinstance(replacement, str):
        raise PolicyError(f"{where}: replacement must be a string")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern:
            raise PolicyError(f"{where}: pattern must be a non-empty string")
        try:
            re2.compile(_pattern_source(pattern), _options())
        except re2.error as e:
            raise PolicyError(f"{where}: not an RE2 pattern ({e})") from None
        reach = _pattern_reach(pattern, declared)
    else:
        folded = [normalize(t)[0] for t in terms]
        if not all(folded):
            raise PolicyError(f"{where}: a term is empty once normalized")
        reach = max(map(len, folded))
    return Rule(rid, action, tuple(terms or ()), pattern, frozenset(applies),
                None if tenants is None else frozenset(map(_tenant_id, tenants)), replacement, max(1, reach))


def parse_policy(data: Any) -> tuple[Rule, ...]:
    """The rules of a policy document.

    Raises:
        PolicyError: the document is not a policy (the message says where).
    """
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise PolicyError('a policy is an object with a "rules" list')
    rules = tuple(_rule(r, i) for i, r in enumerate(data["rules"]))
    ids = [r.id for r in rules]
    if len(set(ids)) != len(ids):
        raise PolicyError("rule ids must be unique")
    return rules


def load_policy(path: Path) -> tuple[Rule, ...]:
    """The rules of a policy file (.json, or .yaml/.yml with PyYAML).

    Raises:
        PolicyError: unreadable, not JSON/YAML, or not a policy.
    """
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise PolicyError(f"cannot read {path}: {e.strerror}") from None
    try:
        if Path(path).suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except ImportError:
        raise PolicyError("a YAML policy needs PyYAML (pip install pyyaml); or write it as JSON") from None
    except Exception as e:
        raise PolicyError(f"{path} is not valid {'YAML' if Path(path).suffix in ('.yaml', '.yml') else 'JSON'}: "
                          f"{e}") from None
    return parse_policy(data)


# ---- matching ---------------------------------------------------------------------------------------
def _options() -> re2.Options:
    options = re2.Options()
    options.case_sensitive = False  # the text is case-folded; a pattern's capitals still match it
    options.log_errors = False
    return options


def _pattern_source(pattern: str) -> str:
    # decomposed as the text is (NFKD leaves ASCII, and so every escape, as it is)
    return unicodedata.normalize("NFKD", pattern)


class Matcher:
    """Every match of a set of rules in a normalized text, in time linear in the text: one Aho-Corasick
    automaton over all the rules' terms, one RE2 set that says which patterns match, then only those
    patterns' own scans (RE2: no backtracking, so no pattern or input is hostile)."""

    def __init__(self, rules: Iterable[Rule]):
        self.rules = tuple(rules)
        self.reach = max((r.reach for r in self.rules), default=0)
        by_term: dict[str, list[Rule]] = {}
        for rule in self.rules:
            for term in rule.terms:  # in both forms where stacked combining marks make them differ (`fold`)
                for form in {normalize(term)[0], fold(term)}:
                    by_term.setdefault(form, []).append(rule)
        self.automaton = None
        if by_term:
            self.automaton = ahocorasick.Automaton()
            for term, owners in by_term.items():
                self.automaton.add_word(term, (len(term), tuple(owners)))
            self.automaton.make_automaton()
        self.patterns = [r for r in self.rules if r.pattern is not None]
        self.regexes = [re2.compile(_pattern_source(r.pattern), _options()) for r in self.patterns]
        self.set = None
        if self.patterns:
            self.set = re2.Set.SearchSet(_options())
            for r in self.patterns:
                self.set.Add(_pattern_source(r.pattern))
            self.set.Compile()

    def find(self, text: str) -> list[Match]:
        """Every term occurrence (overlaps too) and every pattern's leftmost non-overlapping matches,
        sorted by start."""
        found: list[Match] = []
        if self.automaton is not None and text:
            for end, (length, owners) in self.automaton.iter(text):
                for rule in owners:
                    found.append(Match(end + 1 - length, end + 1, rule))
        if self.set is not None and text:
            for i in self.set.Match(text) or ():
                rule = self.patterns[i]
                found.extend(Match(m.start(), m.end(), rule) for m in self.regexes[i].finditer(text)
                             if m.end() > m.start())
        found.sort(key=lambda m: (m.start, m.end))
        return found


def masked(text: str, source: list[int] | None, matches: list[Match], limit: int, base: int = 0) -> str:
    """`text[:limit]` with every mask match inside it replaced (`source`: normalized offset -> original
    offset, `base` more than the offset in `text`)."""
    out, at = [], 0
    for m in matches:
        if m.rule.action != "mask":
            continue
        start = m.start if source is None else source[m.start] - base
        end = m.end if source is None else source[m.end - 1] + 1 - base
        if end > limit:
            continue
        if start < at:  # overlapping the one masked before: one replacement covers both
            at = max(at, end)
            continue
        out.append(text[at:start])
        out.append(m.rule.replacement)
        at = end
    out.append(text[at:limit])
    return "".join(out)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a screen says of a text: what may be released now, and the block rule that matched (if any)."""

    text: str
    blocked: Rule | None = None


@dataclass(slots=True)
class AnswerScreen:
    """One streamed text (a choice's answer or thought) screened as it grows. It holds back the last
    reach - 1 normalized characters (reach: the longest rule's), and any match that crosses that line:
    a match not yet complete begins in what is held, so no part of it is ever released; mask matches
    are replaced before release; a block match ends the text (`Verdict.blocked`), nothing more released.

        released | held: ≥ reach-1 normalized chars, and every match crossing the cut
    """

    matcher: Matcher
    held: str = ""  # original text not released
    norm: str = ""  # its normalized form
    source: list[int] = field(default_factory=list)  # normalized offset -> offset in the whole text
    base: int = 0  # the whole text's offset of held[0]
    released: str = ""  # everything released so far (masked)
    blocked: Rule | None = None
    matched: list[Rule] = field(default_factory=list)  # rules that matched (for the metrics), in order
    seconds: float = 0.0  # time spent screening

    def feed(self, delta: str, is_last: bool = False) -> Verdict:
        """Add `delta`; `is_last`: the text ends with it, so nothing is held back."""
        if self.blocked is not None:
            return Verdict("", self.blocked)
        t0 = time.perf_counter()
        try:
            return self._feed(delta, is_last)
        finally:
            self.seconds += time.perf_counter() - t0

    def _feed(self, delta: str, is_last: bool) -> Verdict:
        if delta:
            norm, source = normalize(delta)
            end = self.base + len(self.held)
            self.source.extend(range(end, end + len(norm)) if source is None else [end + i for i in source])
            self.held += delta
            self.norm += norm
        matches = self.matcher.find(self.norm)
        for m in matches:
            if m.rule.action == "block":
                self.blocked = m.rule
                self.matched.append(m.rule)
                return Verdict("", m.rule)
        cut = len(self.norm) if is_last else max(0, len(self.norm) - (self.matcher.reach - 1))
        for m in matches:  # a match crossing the cut stays held whole (sorted by start: one pass is enough)
            if m.start < cut < m.end:
                cut = m.start
        held_cut = len(self.held) if cut >= len(self.norm) else self.source[cut] - self.base
        while cut > 0 and self.source[cut - 1] - self.base >= held_cut:  # one original character never splits
            cut -= 1
        done = [m for m in matches if m.end <= cut]
        self.matched.extend(m.rule for m in done if m.rule.action == "mask")
        text = masked(self.held, self.source, done, held_cut, self.base)
        self.held, self.norm, self.source = self.held[held_cut:], self.norm[cut:], self.source[cut:]
        self.base += held_cut
        self.released += text
        return Verdict(text)


class OutputScreen:
    """A choice's engine outputs, screened: its answer text and its thought each through an
    `AnswerScreen`. Every output comes back with only what may be released in its deltas, and its
    `text`/`reasoning` as released so far; once a rule blocks, the outputs until the engine's last one
    (the caller aborts the request) carry nothing, and the last says `finish_reason: "content_filter"`."""

    def __init__(self, matcher: Matcher):
        self.answer, self.thought = AnswerScreen(matcher), AnswerScreen(matcher)

    @property
    def blocked(self) -> Rule | None:
        return self.answer.blocked or self.thought.blocked

    @property
    def seconds(self) -> float:
        return self.answer.seconds + self.thought.seconds

    @property
    def matched(self) -> list[Rule]:
        return self.thought.matched + self.answer.matched

    def screen(self, out: RequestOutput) -> RequestOutput | None:
        """The output as the client may see it; None for one that says nothing once blocked."""
        was_blocked = self.blocked is not None
        if not was_blocked:
            thought = self.thought.feed(out.delta_reasoning, out.finished)
            if thought.blocked is None:
                answer = self.answer.feed(out.delta_text, out.finished)
            else:
                answer = Verdict("")
        if self.blocked is not None:
            if not out.finished and was_blocked:
                return None
            delta_text = delta_reasoning = ""
            if not was_blocked and self.answer.blocked is not None:
                delta_reasoning = thought.text  # the thought ended before the answer was blocked
            return replace(out, delta_text=delta_text, delta_reasoning=delta_reasoning, text=self.answer.released,
                           reasoning=self.thought.released, finished=out.finished,
                           finish_reason="content_filter" if out.finished else out.finish_reason,
                           stop_reason=self.blocked.id if out.finished else out.stop_reason,
                           state=MetaState.POLICY_BLOCKED, state_index=0)
        return replace(out, delta_text=answer.text, delta_reasoning=thought.text, text=self.answer.released,
                       reasoning=self.thought.released)


# ---- the policy and its file -------------------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    """A loaded set of rules, with a matcher per (tenant's rule set, scope), built on first use."""

    rules: tuple[Rule, ...]
    _matchers: dict = field(default_factory=dict, compare=False, repr=False)

    def matcher(self, tenant: str, scope: str) -> Matcher | None:
        """The matcher of the rules for `tenant` in `scope` ("prompt" or "answer"); None when none applies."""
        chosen = tuple(r for r in self.rules if r.is_for(tenant, scope))
        if not chosen:
            return None
        matcher = self._matchers.get(chosen)
        if matcher is None:
            matcher = self._matchers[chosen] = Matcher(chosen)
        return matcher


class PromptVerdict(NamedTuple):
    blocked: Rule | None
    matched: list[Rule]  # every rule that matched, blocks and masks
    seconds: float


def screen_prompt(matcher: Matcher, texts: list[str]) -> PromptVerdict:
    """Whether any of a prompt's texts (system, messages, tool calls and results, documents) matches a
    block rule; mask rules are applied by `mask_prompt`."""
    t0 = time.perf_counter()
    matched: list[Rule] = []
    for text in texts:
        for m in matcher.find(fold(text)):
            matched.append(m.rule)
            if m.rule.action == "block":
                return PromptVerdict(m.rule, matched, time.perf_counter() - t0)
    return PromptVerdict(None, matched, time.perf_counter() - t0)


def mask_text(matcher: Matcher, text: str) -> str:
    """The text with every mask rule's matches replaced."""
    if not any(m.rule.action == "mask" for m in matcher.find(fold(text))):
        return text
    norm, source = normalize(text)  # the spans, only for a text that has something to mask
    return masked(text, source, matcher.find(norm), len(text))


def prompt_texts(messages: list[dict[str, Any]]) -> list[str]:
    """Every text of chat messages a rule reads: contents, tool calls' arguments, tool results."""
    texts: list[str] = []
    for m in messages:
        if isinstance(m.get("content"), str):
            texts.append(m["content"])
        for call in m.get("tool_calls") or ():
            args = (call.get("function") or {}).get("arguments")
            texts.append(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    return texts


def mask_messages(matcher: Matcher, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with mask rules applied to their contents and tool calls' arguments."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), str):
            m["content"] = mask_text(matcher, m["content"])
        if m.get("tool_calls"):
            m["tool_calls"] = [_mask_call(matcher, c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _mask_call(matcher: Matcher, call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        fn["arguments"] = mask_text(matcher, args)
    elif args is not None:
        fn["arguments"] = json.loads(mask_text(matcher, json.dumps(args, ensure_ascii=False)))
    return {**call, "function": fn}


class PolicyStore:
    """The server's policy, from its file: reloaded when the file changes (its mtime, looked at every
    RELOAD_CHECK_S) or on SIGHUP (`mark_stale`). A request takes the policy once and keeps it, so a
    reload never changes a request in flight; a file that no longer loads keeps the last good policy."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._mtime = self._stat()
        self.policy = Policy(load_policy(self.path))  # raises PolicyError: the server does not start
        _invisible()  # built now, not by the first request with a non-ASCII prompt
        self._checked = time.monotonic()
        self._stale = False
        self._lock = threading.Lock()
        self.num_reloads = 0

    def _stat(self) -> float | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns

    def mark_stale(self) -> None:
        """Reload on the next request (a SIGHUP handler calls this)."""
        self._stale = True

    def current(self) -> Policy:
        now = time.monotonic()
        if self._stale or now - self._checked >= RELOAD_CHECK_S:
            with self._lock:
                self._checked = now
                mtime = self._stat()
                if self._stale or (mtime is not None and mtime != self._mtime):
                    self._stale, self._mtime = False, mtime
                    try:
                        self.policy = Policy(load_policy(self.path))
                        self.num_reloads += 1
                        log.info("content policy reloaded from %s: %d rules", self.path, len(self.policy.rules))
                    except PolicyError as e:
                        log.error("content policy %s not reloaded, the last one stays: %s", self.path, e)
        return self.policy


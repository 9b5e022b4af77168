"""Seeded serving workloads for `stratum bench serve`: conversations of user turns, built from a fixed word list.

Nothing is downloaded and nothing is tokenized here: sizes are approximate tokens at CHARS_PER_TOKEN
characters each, so one (workload, seed) is the same text for every server compared.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

CHARS_PER_TOKEN = 4  # English text in a typical BPE vocabulary; sizes here are approximate on purpose
WORKLOADS = ("shared-prefix", "multiturn", "mixed-long", "unique")

# Ordinary English words, so any BPE vocabulary tokenizes the text like prose.
WORDS = (
    "the of and to in is was for on that with as by at from his her they this which be are an or had not "
    "but what all were when we there can been has more if will one would about out so up into them time "
    "some could she these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come since "
    "against go came right used take three city river music garden system memory engine token model server "
    "request window light water stone market letter number question answer story house school family "
    "country morning evening summer winter open small large quick brown lazy simple careful early late "
    "bridge harbor forest mountain valley island village station library museum kitchen window travel "
    "history science planet energy signal pattern measure reason method result record season weather"
).split()
QUESTION_STARTS = ("What is", "Why does", "How can", "When did", "Where is", "Who made", "Which one of",
                   "Explain why", "Describe how", "Tell me about")


@dataclass(frozen=True, slots=True)
class Conversation:
    """One client session: an optional system prompt and the user turns, sent in order.

    Every turn after the first is sent with the whole history, including the replies the server gave,
    so the turns of one conversation run one after another.
    """

    user_turns: tuple[str, ...]
    system: str | None = None
    kind: str = "short"  # "short" or "long": mixed-long reports the TTFT of short requests separately
    prefill: str = ""  # the start of the answer, sent as a final assistant message that the server continues


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Sizes of a workload. Token counts are approximate (CHARS_PER_TOKEN characters each)."""

    num_requests: int = 64
    seed: int = 0
    prefix_tokens: int = 600  # shared-prefix: the common system prompt
    question_tokens: int = 24  # every short question
    long_tokens: int = 1500  # mixed-long: the document to summarise
    long_every: int = 8  # mixed-long: one long request in each run of this many
    num_turns: int = 4  # multiturn: turns per conversation


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    config: WorkloadConfig
    conversations: tuple[Conversation, ...] = field(default_factory=tuple)

    @property
    def num_requests(self) -> int:
        return sum(len(c.user_turns) for c in self.conversations)


def make_text(rng: random.Random, num_tokens: int) -> str:
    """Prose of about num_tokens tokens: sentences of 8-16 random words, capitalised, with full stops."""
    target = max(1, num_tokens) * CHARS_PER_TOKEN
    sentences: list[str] = []
    length = 0
    while length < target:
        words = rng.choices(WORDS, k=rng.randint(8, 16))
        sentence = " ".join(words).capitalize() + "."
        sentences.append(sentence)
        length += len(sentence) + 1
    return " ".join(sentences)


def make_question(rng: random.Random, num_tokens: int) -> str:
    """A question of about num_tokens tokens (at least a few words)."""
    start = rng.choice(QUESTION_STARTS)
    num_words = max(3, (num_tokens * CHARS_PER_TOKEN - len(start)) // 6)  # ~5 letters and a space per word
    return f"{start} {' '.join(rng.choices(WORDS, k=num_words))}?"


def _distinct_questions(rng: random.Random, n: int, num_tokens: int) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        q = make_question(rng, num_tokens)
        if q not in seen:
            seen.add(q)
            out.append(q)
    return out


def make_workload(name: str, config: WorkloadConfig) -> Workload:
    """Build a named workload; the same (name, config) always gives the same text.

    Shapes:
        unique: num_requests single-turn conversations, each a distinct short question.
        shared-prefix: the same ~prefix_tokens system prompt on every request, distinct short questions.
        multiturn: ceil(num_requests / num_turns) conversations of num_turns distinct short questions
            (the last one shorter if it does not divide), so exactly num_requests requests.
        mixed-long: single-turn; in each run of long_every requests one, at a seeded position, asks to
            summarise a distinct ~long_tokens document (kind "long"); the rest are short questions.
    Raises:
        ValueError: an unknown name or a non-positive size.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if config.num_requests < 1 or config.num_turns < 1 or config.long_every < 1:
        raise ValueError("num_requests, num_turns and long_every must be positive")
    rng = random.Random(config.seed)
    n = config.num_requests
    questions = _distinct_questions(rng, n, config.question_tokens)
    if name == "unique":
        convs = [Conversation((q,)) for q in questions]
    elif name == "shared-prefix":
        system = "You are a helpful assistant. Use the background below to answer.\n\n" + make_text(
            rng, config.prefix_tokens)
        convs = [Conversation((q,), system=system) for q in questions]
    elif name == "multiturn":
        t = config.num_turns
        convs = [Conversation(tuple(questions[i : i + t])) for i in range(0, n, t)]
    else:  # mixed-long
        convs = []
        long_at = -1
        for i, q in enumerate(questions):
            if i % config.long_every == 0:
                long_at = i + rng.randrange(config.long_every)
            if i == long_at:
                doc = make_text(rng, config.long_tokens)
                convs.append(Conversation((f"Summarise the following document in three sentences.\n\n{doc}",),
                                          kind="long"))
            else:
                convs.append(Conversation((q,)))
    return Workload(name, config, tuple(convs))

"""The engine boundary's language: every command the serving side sends an engine loop, every event the
loop sends back, every message of an engine's start-up and what a replica of several tells the
ingress, as typed records, and the one codec that turns them into plain lists and back.

The thread transport hands the records over as they are; the process transport (msgpack frames,
`stratum.engine.process`) and the Ray transport (`stratum.cluster`) send `encode(message)` and read
`decode(data)`, or `StreamDecoder` where running outputs carry only their deltas. Plain data, no torch.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Callable, Literal, Union

from stratum.engine.config import ResolvedConfig, SchedulerConfig
from stratum.engine.outputs import EngineDeadError, MetaState, RequestOutput, RequestStats
from stratum.engine.reasoning import Reasoning
from stratum.engine.request import CachePolicy
from stratum.engine.sampling_params import InvalidRequestError, SamplingParams


# ---- what the engine publishes ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KVBlocks:
    total: int
    free: int
    cached: int
    in_use: int


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the engine looked like after its last step, published by the engine, read by anyone.

    A field added here is filled in by `EngineCore.snapshot`; a replica set's snapshot (`summed`)
    adds it up across the replicas (numbers, records of numbers) or names it per replica (text)."""

    alive: bool
    mode: str = "normal"
    degraded_reason: str | None = None
    error: str | None = None  # why the loop died
    num_running: int = 0
    num_waiting: int = 0  # in the scheduler's queue (preempted requests included)
    kv_blocks: KVBlocks = KVBlocks(0, 0, 0, 0)
    num_preemptions: int = 0
    num_steps: int = 0
    overhead_ratio: float = 0.0  # time outside the model forward / step time, over recent steps
    mean_step_s: float = 0.0  # over recent steps
    threads: int = 0
    rss_mb: float = 0.0  # the engine process's resident memory
    gpu_memory_allocated_mb: float | None = None
    step: str = ""  # "native" or "pytorch": what runs the model now
    preparing: str | None = None  # a cold start's kernels being prepared in the background: the stage
    # per tier of the prefix cache ("pool", "disk"): hit tokens, bytes read / written, evicted blocks,
    # size (`disk_tier.DiskTier.report`)
    kv_tiers: dict = field(default_factory=dict)
    num_engines: int = 1  # engine loops behind it: 1, or a replica set's live replicas

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks.in_use / self.kv_blocks.total if self.kv_blocks.total else 0.0

    @classmethod
    def summed(cls, named: dict[str, "EngineSnapshot"]) -> "EngineSnapshot":
        """Several engines' snapshots (by replica name, at least one) as one: alive while any engine
        is, the step figures weighted by steps (the mean step the slowest's), text said per replica
        ("name: reason; ..."), and the rest, counts and sizes, added up."""
        snaps = list(named.values())
        alive = [s for s in snaps if s.alive]
        steps = sum(s.num_steps for s in snaps)
        rules = {
            "alive": bool(alive), "mode": "normal" if all(s.mode == "normal" for s in alive) else "basic",
            "error": None if alive else "; ".join(f"{n}: {s.error}" for n, s in named.items()),
            "overhead_ratio": sum(s.overhead_ratio * s.num_steps for s in snaps) / steps if steps else 0.0,
            "mean_step_s": max(s.mean_step_s for s in snaps),
            "step": "+".join(sorted({s.step for s in alive if s.step})),
            "num_engines": len(alive),
            "kv_tiers": _summed_tiers(snaps),
        }
        values = {}
        for f in fields(cls):
            each = [getattr(s, f.name) for s in snaps]
            if f.name in rules:
                values[f.name] = rules[f.name]
            elif any(isinstance(v, str) for v in each):
                values[f.name] = "; ".join(f"{n}: {v}" for n, v in zip(named, each) if v) or None
            else:
                values[f.name] = _total(each)
        return cls(**values)


def _summed_tiers(snaps: list[EngineSnapshot]) -> dict:
    """The replicas' tier figures added up, except the disk tier's size and bound: one tier on the
    machine, which every replica reports whole."""
    out: dict[str, dict] = {}
    for snap in snaps:
        for tier, figures in snap.kv_tiers.items():
            into = out.setdefault(tier, {})
            for name, value in figures.items():
                shared = tier == "disk" and name in ("size_bytes", "blocks", "limit_bytes", "enabled")
                into[name] = max(into.get(name, 0), value) if shared else into.get(name, 0) + value
    return out


def _total(values: list):
    """Numbers added up (None where every one is None); records of numbers, field by field."""
    if is_dataclass(values[0]):
        return type(values[0])(*(_total([getattr(v, f.name) for v in values]) for f in fields(values[0])))
    present = [v for v in values if v is not None]
    return sum(present) if present else None


@dataclass(frozen=True)
class EngineInfo:
    """The engine's resolved configuration and kernel choices (`EngineCore.info`): its start-up's last
    message (it is ready), and an event when a cold start switches to its prepared kernels
    (`EngineCore.switch_kernels`), the one time they change."""

    config: ResolvedConfig
    model_name: str  # the checkpoint's own name
    vocab_size: int
    kernel_choices: dict[str, Any]
    model_facts: dict[str, Any] = field(default_factory=dict)  # the checkpoint's shape and size (`models.facts`)
    # what it serves: "generate", "embed" (a vector per input, pooled as `pooling` says: "mean", "cls",
    # "last"), "score" (a cross-encoder's relevance of a pair); the vector's size (0: no embeddings)
    tasks: tuple[str, ...] = ("generate",)
    pooling: str | None = None
    embedding_size: int = 0



# ---- start-up: an engine process or replica -> serving side, before EngineInfo -------------------------
@dataclass(frozen=True, slots=True)
class Starting:
    """The engine's start-up began a stage ("loading model")."""

    stage: str


@dataclass(frozen=True, slots=True)
class TokenizerData:
    """A model's tokenizer (`TextTokenizer`) and chat template source as plain data, sent as soon as
    the checkpoint is read: the serving side builds its own copy while the engine builds the model."""

    json: str
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos: bool
    chat_template: str | None

    @classmethod
    def of(cls, tok, chat_template: str | None) -> "TokenizerData":
        return cls(tok.backend.to_str(), tok.bos_token, tok.eos_token, tok.bos_token_id, list(tok.eos_token_ids),
                   tok.add_bos, chat_template)

    def build(self):
        """(TextTokenizer, ChatTemplate)."""
        from tokenizers import Tokenizer

        from stratum.models.chat_template import ChatTemplate
        from stratum.models.tokenizer import TextTokenizer

        tokenizer = TextTokenizer(Tokenizer.from_str(self.json), self.bos_token, self.eos_token, self.bos_token_id,
                                  tuple(self.eos_token_ids), self.add_bos)
        return tokenizer, ChatTemplate(self.chat_template, tokenizer)


@dataclass(frozen=True, slots=True)
class StartFailed:
    """The engine could not start (a bad model, a missing file); the engine process exits after it."""

    reason: str


# ---- commands: serving side -> engine loop -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue one request; the fields after `sampling` are `EngineCore.add_request`'s options."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    cache_policy: CachePolicy | None = None
    tool_marker: str | None = None
    pin_prefixes: list[tuple[int, float]] = field(default_factory=list)  # (prefix length, ttl seconds)
    low_latency: bool = False
    fork_of: str | None = None  # an earlier request of the same prompt whose computed prompt it starts from
    reasoning: Reasoning | None = None  # a reasoning model's thought: its markers and budget
    # "generate"; "embed" or "score": prefill only, its output's `embedding` the pooled vector (or the score)
    task: str = "generate"


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class ListHeld:
    """Ask for the prefix cache's most recently used block keys (answered by `HeldKeys`)."""

    max_keys: int


@dataclass(frozen=True, slots=True)
class Stop:
    """End the engine process (the process transport's last command)."""


# ---- events: engine loop -> serving side (besides RequestOutput and EngineSnapshot) -------------------
@dataclass(frozen=True, slots=True)
class Accepted:
    """The request is queued; its prefix-cache hit is expected to be this many tokens."""

    request_id: str
    expected_cached_tokens: int


@dataclass(frozen=True, slots=True)
class Started:
    """These requests left the waiting queue: they are scheduled."""

    request_ids: list[str]


FailureKind = Literal["invalid_request", "unavailable", "internal"]


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """The request ended without a last output."""

    request_id: str
    message: str
    kind: FailureKind

    def exception(self) -> Exception:
        """What the request's reader raises."""
        error = {"invalid_request": InvalidRequestError, "unavailable": EngineDeadError}.get(self.kind, RuntimeError)
        return error(self.message)


@dataclass(frozen=True, slots=True)
class HeldKeys:
    """The prefix cache's block keys (short form), most recent first: the answer to `ListHeld`."""

    keys: list[int]


@dataclass(frozen=True, slots=True)
class EngineDied:
    """The engine loop is gone; always its last event."""

    reason: str


@dataclass(frozen=True, slots=True)
class Routed:
    """The replica (of several) that serves the request."""

    request_id: str
    replica: str


# ---- a replica of several -> the ingress, through Ray Serve's calls (`stratum.cluster`) -----------------
@dataclass(frozen=True, slots=True)
class ReplicaDescription:
    """What the ingress needs before its first request (`EngineReplica.describe`): the engine's process,
    its configuration and kernel choices, its tokenizer and chat template, and how it looks now."""

    pid: int
    info: EngineInfo
    tokenizer: TokenizerData
    snapshot: EngineSnapshot


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """A replica's routing stats (`EngineReplica.record_routing_stats`, read by the router's
    `update_replicas`): when it reported, the calls it serves, its engine's snapshot, and the block keys
    its prefix cache holds, most recent first, as its engine listed them at `held_at` (its clock)."""

    pid: int
    at: float
    calls: int
    snapshot: EngineSnapshot
    held: list[int]
    held_at: float


# Serve's routing stats are a dict: the replica's `ReplicaReport`, encoded, is its one entry.
ROUTING_STATS_KEY = "report"

Command = Union[AddRequest, Abort, ListHeld, Stop]
Event = Union[RequestOutput, EngineSnapshot, Accepted, Started, RequestFailed, HeldKeys, EngineDied, Routed, EngineInfo]
StartupMessage = Union[Starting, TokenizerData, StartFailed, EngineInfo]
ReplicaMessage = Union[ReplicaDescription, ReplicaReport]
Message = Union[Command, Event, StartupMessage, ReplicaMessage]


# ---- the codec: [tag, field, field, ...], nested records as lists of their fields, nested messages as
# their own encoding ----------------------------------------------------------------------------------
def _record(cls) -> Callable[[list | None], Any]:
    return lambda values: None if values is None else cls(*values)


def _message(data: list) -> Any:
    """A message nested in another (`decode`, defined below)."""
    return decode(data)


def _config(d: dict) -> ResolvedConfig:
    from stratum.kernels import KernelPlan
    from stratum.kernels.numerics import Numerics

    d = dict(d)
    d["kernel_plan"] = KernelPlan(**d["kernel_plan"])
    d["numerics"] = Numerics.from_dict(d["numerics"])
    d["scheduler"] = SchedulerConfig(**d["scheduler"])
    return ResolvedConfig(**d)


# A message's tag is its index here (both sides run the same code), with how its nested fields are rebuilt.
_MESSAGES: dict[type, dict[str, Callable]] = {
    RequestOutput: {"stats": _record(RequestStats), "state": MetaState},
    EngineSnapshot: {"kv_blocks": _record(KVBlocks)},
    Accepted: {}, Started: {}, RequestFailed: {}, HeldKeys: {}, EngineDied: {}, Routed: {},
    EngineInfo: {"config": _config, "tasks": tuple},
    AddRequest: {"sampling": _record(SamplingParams), "cache_policy": _record(CachePolicy),
                 "pin_prefixes": lambda prefixes: [tuple(p) for p in prefixes], "reasoning": _record(Reasoning)},
    Abort: {}, ListHeld: {}, Stop: {},
    Starting: {}, TokenizerData: {}, StartFailed: {},
    ReplicaDescription: {"info": _message, "tokenizer": _message, "snapshot": _message},
    ReplicaReport: {"snapshot": _message},
}
_TAGS = {cls: tag for tag, cls in enumerate(_MESSAGES)}
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in _MESSAGES}
_RECORD_FIELDS = {cls: tuple(f.name for f in fields(cls))  # the records nested in messages
                  for cls in (RequestStats, KVBlocks, SamplingParams, CachePolicy, Reasoning)}
_DECODERS = [(cls, [(_FIELDS[cls].index(name), rebuild) for name, rebuild in nested.items()])
             for cls, nested in _MESSAGES.items()]
_SENT_TEXT = [1 + _FIELDS[RequestOutput].index(name)  # positions in a message
              for name in ("text", "token_ids", "reasoning")]


def encode(message: Message) -> list:
    """[tag, field values...] with nested records as lists of their field values, and nested messages
    (a replica's description carries its engine's) as their own encoding (msgpack-ready).

    A running RequestOutput carries only its deltas (`text`, `token_ids` and `reasoning` are None): the
    reader assembles them (`StreamDecoder`). A finished one also carries its full text and tokens.
    """
    cls = type(message)
    values = [_TAGS[cls]]
    for name in _FIELDS[cls]:
        value = getattr(message, name)
        nested = _RECORD_FIELDS.get(type(value))
        if nested is not None:
            value = [getattr(value, f) for f in nested]
        elif type(value) is ResolvedConfig:  # records nested in it too: as a dict
            value = asdict(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        elif type(value) in _TAGS:
            value = encode(value)
        values.append(value)
    if cls is RequestOutput and not message.finished:
        for i in _SENT_TEXT:
            values[i] = None
    return values


def decode(data: list) -> Message:
    """The message `encode` made (a running output as it was sent: deltas only)."""
    cls, nested = _DECODERS[data[0]]
    values = data[1:]
    for i, rebuild in nested:
        values[i] = rebuild(values[i])
    return cls(*values)


class StreamDecoder:
    """Decodes one stream of events, assembling each running request's text and tokens from its deltas."""

    def __init__(self):
        # request id -> (text pieces, token ids, thought pieces)
        self._partial: dict[str, tuple[list[str], list[int], list[str]]] = {}

    def decode(self, data: list) -> Event:
        event = decode(data)
        match event:
            case RequestOutput(finished=True):
                self._partial.pop(event.request_id, None)
            case RequestOutput():
                pieces, ids, thought = self._partial.setdefault(event.request_id, ([], [], []))
                pieces.append(event.delta_text)
                ids.extend(event.delta_token_ids)
                thought.append(event.delta_reasoning)
                event.text, event.token_ids, event.reasoning = "".join(pieces), list(ids), "".join(thought)
            case RequestFailed(request_id=rid):
                self._partial.pop(rid, None)
        return event

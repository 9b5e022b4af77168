"""The engine loop in a process of its own, behind the same `EngineClient`.

The serving process starts `python -m stratum.engine.process` with two pipes: commands go down one,
events come up the other, as msgpack frames (typed fields, no pickle). The engine process loads the
model, sends one "ready" message (its resolved configuration, kernel choices, tokenizer and chat
template, so the serving side never loads the weights), then one frame per step holding every event
of that step: tokens stream back without a round trip per token.

Either side notices the other's death: the engine process stops when its command pipe closes; the
serving side reads end-of-file when the engine process exits, for whatever reason, and ends every
request in flight.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import asdict, fields

import msgpack

from stratum.engine.client import EngineClient, EngineInfo, EngineSnapshot, KVBlocks
from stratum.engine.config import EngineConfig, ResolvedConfig, SchedulerConfig
from stratum.engine.outputs import RequestOutput, RequestStats
from stratum.engine.request import CachePolicy
from stratum.engine.sampling_params import SamplingParams

log = logging.getLogger("stratum.engine")

_READ_SIZE = 1 << 16


class EngineStartError(RuntimeError):
    """The engine process exited before it was ready; the message holds its reason."""


# ---- the wire format: plain lists and dicts --------------------------------------------------------
def _pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


def _messages(fd: int):
    """The messages read from fd, in order, until end-of-file."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=1 << 30)
    while data := os.read(fd, _READ_SIZE):
        unpacker.feed(data)
        yield from unpacker


def _values(obj) -> list:
    """A dataclass's fields in declaration order (the other side rebuilds it positionally)."""
    return [getattr(obj, f.name) for f in fields(obj)]


def encode_output(out: RequestOutput) -> list:
    """A running request's output carries only its deltas (the serving side accumulates text and
    tokens); a finished one also carries its full text and tokens, which are authoritative."""
    values = dict(zip(_OUTPUT_FIELDS, _values(out)))
    if not out.finished:
        values["text"] = values["token_ids"] = None
    if out.stats is not None:
        values["stats"] = _values(out.stats)
    return list(values.values())


def decode_output(values: list) -> RequestOutput:
    out = RequestOutput(*values)
    if out.stats is not None:
        out.stats = RequestStats(*out.stats)
    return out


def encode_snapshot(s: EngineSnapshot) -> list:
    values = dict(zip(_SNAPSHOT_FIELDS, _values(s)))
    values["kv_blocks"] = _values(s.kv_blocks)
    return list(values.values())


def decode_snapshot(values: list) -> EngineSnapshot:
    values = dict(zip(_SNAPSHOT_FIELDS, values))
    values["kv_blocks"] = KVBlocks(*values["kv_blocks"])
    return EngineSnapshot(**values)


_OUTPUT_FIELDS = [f.name for f in fields(RequestOutput)]
_SNAPSHOT_FIELDS = [f.name for f in fields(EngineSnapshot)]


def encode_event(event: tuple) -> list:
    kind = event[0]
    if kind == "out":
        return ["out", encode_output(event[1])]
    if kind == "snapshot":
        return ["snapshot", encode_snapshot(event[1])]
    return list(event)


def encode_command(command: tuple) -> list:
    if command[0] != "add":
        return list(command)
    _, rid, ids, sampling, kwargs = command
    kwargs = dict(kwargs)
    if kwargs.get("cache_policy") is not None:
        kwargs["cache_policy"] = asdict(kwargs["cache_policy"])
    return ["add", rid, ids, {f.name: getattr(sampling, f.name) for f in fields(SamplingParams)}, kwargs]


def decode_command(command: list) -> tuple:
    if command[0] != "add":
        return tuple(command)
    _, rid, ids, sampling, kwargs = command
    if kwargs.get("cache_policy") is not None:
        kwargs["cache_policy"] = CachePolicy(**kwargs["cache_policy"])
    if kwargs.get("pin_prefixes"):
        kwargs["pin_prefixes"] = [tuple(p) for p in kwargs["pin_prefixes"]]
    return ("add", rid, ids, SamplingParams(**sampling), kwargs)


def encode_info(info: EngineInfo) -> dict:
    return asdict(info)


def decode_info(d: dict) -> EngineInfo:
    from stratum.kernels import KernelPlan

    config = dict(d["config"])
    config["kernel_plan"] = KernelPlan(**config["kernel_plan"])
    config["scheduler"] = SchedulerConfig(**config["scheduler"])
    return EngineInfo(ResolvedConfig(**config), d["model_name"], d["vocab_size"], d["kernel_choices"])


def encode_tokenizer(engine) -> dict:
    """The engine's tokenizer and chat template as plain data, for a serving side elsewhere."""
    tok = engine.tokenizer
    return {"json": tok.backend.to_str(), "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "bos_token_id": tok.bos_token_id, "eos_token_ids": list(tok.eos_token_ids),
            "chat_template": engine.chat_template.source}


def decode_tokenizer(d: dict):
    """(TextTokenizer, ChatTemplate) from `encode_tokenizer`'s data."""
    from tokenizers import Tokenizer

    from stratum.models.chat_template import ChatTemplate
    from stratum.models.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(Tokenizer.from_str(d["json"]), d["bos_token"], d["eos_token"], d["bos_token_id"],
                              tuple(d["eos_token_ids"]))
    return tokenizer, ChatTemplate(d["chat_template"], tokenizer)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# ---- the serving side ------------------------------------------------------------------------------
class EngineProcess:
    """The engine process, started at construction; `connect` waits until its model is loaded.

    The caller may do its own start-up work (imports, the web app) in between, while the engine
    process loads the model.
    """

    def __init__(self, config: EngineConfig):
        cmd_r, self._cmd_w = os.pipe()
        ev_r, ev_w = os.pipe()
        self._ev_r = ev_r
        self.proc = subprocess.Popen([sys.executable, "-m", "stratum.engine.process", "--commands", str(cmd_r),
                                      "--events", str(ev_w), "--config", json.dumps(asdict(config))],
                                     pass_fds=(cmd_r, ev_w))
        os.close(cmd_r)
        os.close(ev_w)
        self._write_lock = threading.Lock()

    def connect(self) -> EngineClient:
        """Wait for the engine to be ready and return the client that talks to it.

        Raises:
            EngineStartError: the engine process failed to load (bad model, missing file, ...).
        """
        messages = _messages(self._ev_r)
        ready = next(messages, None)
        if ready is None:
            ready = ["failed", f"the engine process exited with code {self.proc.wait()} before it was ready"]
        if ready[0] != "ready":
            self.proc.wait(timeout=30)
            raise EngineStartError(ready[1] if len(ready) > 1 else "the engine process failed to start")
        _, info, tok = ready
        tokenizer, template = decode_tokenizer(tok)
        client = EngineClient(decode_info(info), tokenizer, template, self.send, self.shutdown, engine_pid=self.proc.pid)
        threading.Thread(target=_read_events, args=(self._ev_r, messages, client, self.proc),
                         name="stratum-engine-events", daemon=True).start()
        return client

    def send(self, command: tuple) -> None:
        data = _pack(encode_command(command))
        try:
            with self._write_lock:
                _write_all(self._cmd_w, data)
        except OSError:  # the engine process is gone; the event reader reports it
            pass

    def shutdown(self) -> None:
        self.send(("stop",))
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        try:
            os.close(self._cmd_w)
        except OSError:
            pass


def start_process_engine(config: EngineConfig) -> EngineClient:
    """Start the engine process for config and return the client that talks to it, once it is ready."""
    return EngineProcess(config).connect()


def _read_events(fd: int, frames, client: EngineClient, proc: subprocess.Popen) -> None:
    """Frames of events until end-of-file; then the engine process is gone, whatever the reason."""
    partial: dict[str, tuple[list[str], list[int]]] = {}  # request id -> (text pieces, token ids) so far
    dead_said = False
    try:
        for frame in frames:
            events = [_decode_event(e, partial) for e in frame]
            dead_said |= any(e[0] == "dead" for e in events)
            client.deliver(events)
    except Exception as e:  # a broken frame: the engine cannot be trusted any more
        log.exception("engine event stream broke")
        proc.kill()
        client.deliver([("dead", f"engine event stream broke: {type(e).__name__}: {e}")])
        return
    finally:
        os.close(fd)
    code = proc.wait()
    if not dead_said:
        client.deliver([("dead", f"the engine process exited with code {code}")])


def _decode_event(event: list, partial: dict) -> tuple:
    kind = event[0]
    if kind == "out":
        out = decode_output(event[1])
        if out.finished:
            partial.pop(out.request_id, None)
        else:
            pieces, ids = partial.setdefault(out.request_id, ([], []))
            pieces.append(out.delta_text)
            ids.extend(out.delta_token_ids)
            out.text, out.token_ids = "".join(pieces), list(ids)
        return ("out", out)
    if kind == "snapshot":
        return ("snapshot", decode_snapshot(event[1]))
    if kind == "error":
        partial.pop(event[1], None)
    return tuple(event)


# ---- the engine side ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stratum.engine.process")
    p.add_argument("--commands", type=int, required=True, help="fd of the command pipe (read)")
    p.add_argument("--events", type=int, required=True, help="fd of the event pipe (write)")
    p.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = p.parse_args(argv)
    # The serving process decides when this one stops (a Ctrl-C or a service manager's SIGTERM can
    # reach the whole process group): it drains, then closes the command pipe, so in-flight requests
    # end in order rather than by a signal here.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ev_fd = args.events
    lock = threading.Lock()

    def emit(events: list) -> None:
        data = _pack([encode_event(e) for e in events])
        try:
            with lock:
                _write_all(ev_fd, data)
        except BrokenPipeError:  # the serving process is gone: nobody is left to serve
            loop.stop()

    from stratum.engine.client import EngineLoop
    from stratum.engine.core import LLMEngine

    settings = json.loads(args.config)
    settings["scheduler"] = SchedulerConfig(**settings["scheduler"])
    try:
        engine = LLMEngine(EngineConfig(**settings))
    except Exception as e:  # the serving side prints this and exits
        _write_all(ev_fd, _pack(["failed", f"{type(e).__name__}: {e}"]))
        return 1
    _write_all(ev_fd, _pack(["ready", encode_info(EngineInfo.of(engine)), encode_tokenizer(engine)]))
    loop = EngineLoop(engine, emit)

    def read_commands() -> None:
        try:
            for command in _messages(args.commands):
                if command[0] == "stop":
                    return
                loop.submit(decode_command(command))
        finally:
            loop.stop()  # the serving process closed the pipe, or died: nothing is left to serve

    threading.Thread(target=read_commands, name="stratum-engine-commands", daemon=True).start()
    loop.run()
    return 1 if loop.death is not None else 0


if __name__ == "__main__":
    sys.exit(main())

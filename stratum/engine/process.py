"""The engine loop in a process of its own, behind the same `EngineClient`.

The serving process starts `python -m stratum.engine.process` with two pipes: commands go down one,
events come up the other, as msgpack frames (plain lists, no pickle). The engine process loads the
model, sending the stage it is in (`Starting`), its tokenizer and chat template as soon as the
checkpoint is read (`TokenizerData`: the serving side builds its copy while the model is built), then
`EngineInfo` once it is ready (its resolved configuration and kernel choices; the serving side never
loads the weights) or `StartFailed`, then one frame per step holding every event of that step:
tokens stream back without a round trip per token. Every message is a record of
`stratum.engine.protocol` in its codec; `EngineProcess` is the client's transport.

Either side notices the other's death: the engine process stops when its command pipe closes; the
serving side reads end-of-file when the engine process exits, for whatever reason, ends every
request in flight and, when supervised, starts a new engine process (`engine/supervisor.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

import msgpack

from stratum.engine.client import EngineClient, Transport
from stratum.engine.config import EngineConfig
from stratum.engine.faults import Faults
from stratum.engine.loop import EngineLoop
from stratum.engine.supervisor import RestartPolicy, Supervision, Supervisor
from stratum.engine.protocol import (
    Command, EngineDied, EngineInfo, StartFailed, Starting, Stop, StreamDecoder, TokenizerData, decode, encode,
)

log = logging.getLogger("stratum.engine")

_READ_SIZE = 1 << 16


class EngineStartError(RuntimeError):
    """The engine process exited before it was ready; the message holds its reason."""


# ---- the wire: msgpack messages of `stratum.engine.protocol`'s codec --------------------------------
def _pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


def _unpacker() -> msgpack.Unpacker:
    return msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=1 << 30)


def _messages(fd: int, unpacker: msgpack.Unpacker | None = None):
    """The messages read from fd, in order, until end-of-file (what unpacker holds already first)."""
    unpacker = unpacker or _unpacker()
    yield from unpacker
    while data := os.read(fd, _READ_SIZE):
        unpacker.feed(data)
        yield from unpacker


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# ---- the serving side ------------------------------------------------------------------------------
class EngineProcess(Transport):
    """The process transport: the engine process, started at construction; `connect` waits until its
    model is loaded and returns the client built on this transport.

    The caller may do its own start-up work (imports, the web app) in between, while the engine
    process loads the model.

    With `restarts`, an engine process that dies is followed by a new one behind the same client
    (`engine/supervisor.py:Supervisor` decides when, and when to give up): the requests in flight end
    with the engine's error as they would without, the new engine reads the same configuration, and
    its prefix cache's disk tier (`$STRATUM_HOME/kv`) serves what the dead one wrote there.
    """

    def __init__(self, config: EngineConfig, restarts: RestartPolicy | None = None):
        self.config = config
        self.supervisor = Supervisor(restarts) if restarts is not None else None
        self._write_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_stopping = False
        self._num_starts = 0
        self._t0 = time.monotonic()
        self._spawn()

    def _spawn(self) -> None:
        """Start an engine process on new pipes (the command pipe's old end is closed)."""
        cmd_r, cmd_w = os.pipe()
        ev_r, ev_w = os.pipe()
        proc = subprocess.Popen([sys.executable, "-m", "stratum.engine.process", "--commands", str(cmd_r),
                                 "--events", str(ev_w), "--config", self.config.to_json(),
                                 "--start-number", str(self._num_starts)],
                                pass_fds=(cmd_r, ev_w))
        self._num_starts += 1
        os.close(cmd_r)
        os.close(ev_w)
        with self._write_lock:
            old, self._cmd_w, self._ev_r, self.proc = getattr(self, "_cmd_w", None), cmd_w, ev_r, proc
        if old is not None:
            _close(old)

    def _start_up(self, on_stage: Callable[[str], None], build_tokenizer: bool):
        """Read the engine's start-up messages: (its info, tokenizer, template, the unpacker holding
        what came after). Raises EngineStartError when it stops before it is ready."""
        unpacker = _unpacker()
        tokenizer = template = None
        for data in _messages(self._ev_r, unpacker):
            match decode(data):
                case Starting(stage=stage):
                    on_stage(stage)
                case TokenizerData() as sent if build_tokenizer:  # built here while the engine builds its model
                    tokenizer, template = sent.build()
                case EngineInfo() as info:
                    return info, tokenizer, template, unpacker
                case StartFailed(reason=reason):
                    self.proc.wait(timeout=30)
                    _close(self._ev_r)
                    raise EngineStartError(reason)
        _close(self._ev_r)
        raise EngineStartError(f"the engine process exited with code {self.proc.wait()} before it was ready")

    def connect(self, on_stage: Callable[[str], None] = lambda stage: None,
                loop: asyncio.AbstractEventLoop | None = None) -> EngineClient:
        """Wait for the engine to be ready and return the client that talks to it.

        Args:
            on_stage: told each stage of the engine's start-up as it begins ("loading model").
            loop: the running event loop that serves the client (from another thread): its selector
                watches the event pipe, and each step's events are applied right there. Without one,
                a thread reads them and hands them to whichever loop reads the requests, which costs
                a wake-up of that loop per step (a write to its self-pipe, a thread switch).

        Raises:
            EngineStartError: the engine process failed to load (bad model, missing file, ...).
        """
        info, tokenizer, template, unpacker = self._start_up(on_stage, build_tokenizer=True)
        if self.supervisor is not None:
            self.supervisor.started(time.monotonic() - self._t0)
        client = EngineClient(info, tokenizer, template, self, engine_pid=self.proc.pid)
        self._loop = loop
        self._attach(client, unpacker)
        return client

    def _attach(self, client: EngineClient, unpacker: msgpack.Unpacker) -> None:
        reader = _EventReader(self._ev_r, unpacker, client, self.proc, self._ended)
        if self._loop is None:
            threading.Thread(target=reader.run, name="stratum-engine-events", daemon=True).start()
        else:
            self._loop.call_soon_threadsafe(reader.watch, self._loop)

    def _ended(self, client: EngineClient, reason: str, is_said: bool) -> None:
        """The engine process is gone (in a thread of its own): the client hears why, and a supervised
        engine is started again (in this thread) unless this death makes a crash loop."""
        sup = self.supervisor
        delay = sup.died(reason) if sup is not None and not self._is_stopping else None
        said = sup.given_up if sup is not None and sup.given_up else reason
        if not is_said or said != reason:
            client.deliver([EngineDied(said)])
        while delay is not None:
            time.sleep(delay)
            if self._is_stopping:
                return
            try:
                self._spawn()
                info, _, _, unpacker = self._start_up(lambda stage: None, build_tokenizer=False)
            except (EngineStartError, OSError) as e:
                delay = sup.died(f"a new engine process failed to start: {e}")
                if delay is None:
                    client.deliver([EngineDied(sup.given_up)])
                continue
            if self._is_stopping:
                self.proc.kill()
                return
            client.restarted(info, self.proc.pid)
            sup.restarted(self.proc.pid)
            self._attach(client, unpacker)
            return

    def supervision(self) -> Supervision | None:
        return self.supervisor.view() if self.supervisor is not None else None

    def send(self, commands: list[Command]) -> None:
        data = b"".join(_pack(encode(c)) for c in commands)
        try:
            with self._write_lock:
                _write_all(self._cmd_w, data)
        except OSError:  # the engine process is gone; the event reader reports it
            pass

    def shutdown(self) -> None:
        self._is_stopping = True  # no restart after this
        self.send([Stop()])
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        _close(self._cmd_w)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def start_process_engine(config: EngineConfig) -> EngineClient:
    """Start the engine process for config and return the client that talks to it, once it is ready."""
    return EngineProcess(config).connect()


class _EventReader:
    """The engine's frames of events, decoded and delivered to the client until end-of-file; then the
    engine process is gone, whatever the reason, and `on_exit` hears why. `run` reads in a thread of its
    own; `watch` on the client's event loop, as the loop's selector finds the pipe readable."""

    def __init__(self, fd: int, unpacker: msgpack.Unpacker, client: EngineClient, proc: subprocess.Popen,
                 on_exit: Callable[[EngineClient, str, bool], None]):
        self.fd, self.unpacker, self.client, self.proc, self.on_exit = fd, unpacker, client, proc, on_exit
        self.decoder = StreamDecoder()
        self.said: str | None = None  # the death the engine loop reported itself
        self.broke: str | None = None  # a frame that did not decode: the engine was killed

    def run(self) -> None:
        for frame in _messages(self.fd, self.unpacker):
            if not self._deliver(frame):
                break
        self._ended()

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        os.set_blocking(self.fd, False)
        loop.add_reader(self.fd, self._readable, loop)
        self._readable(loop, read=False)  # what connect read past "ready" already

    def _readable(self, loop: asyncio.AbstractEventLoop, read: bool = True) -> None:
        try:
            data = os.read(self.fd, _READ_SIZE) if read else None
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data == b"":
            self._unwatch(loop)
            return
        if data:
            self.unpacker.feed(data)
        for frame in self.unpacker:
            if not self._deliver(frame):
                self._unwatch(loop)
                return

    def _unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self.fd)
        threading.Thread(target=self._ended, name="stratum-engine-exit", daemon=True).start()

    def _deliver(self, frame: list) -> bool:
        """False when the frame is broken: the engine cannot be trusted any more, and is killed."""
        try:
            events = [self.decoder.decode(e) for e in frame]
        except Exception as e:
            log.exception("engine event stream broke")
            self.broke = f"engine event stream broke: {type(e).__name__}: {e}"
            self.proc.kill()
            return False
        for e in events:
            if isinstance(e, EngineDied):
                self.said = e.reason
        self.client.deliver(events)
        return True

    def _ended(self) -> None:
        """End-of-file: the engine process is gone (waited for here, in a thread, so it is no zombie)."""
        _close(self.fd)
        code = self.proc.wait()
        reason = self.broke or self.said or f"the engine process exited with code {code}"
        self.on_exit(self.client, reason, self.broke is None and self.said is not None)


# ---- the engine side ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stratum.engine.process")
    p.add_argument("--commands", type=int, required=True, help="fd of the command pipe (read)")
    p.add_argument("--events", type=int, required=True, help="fd of the event pipe (write)")
    p.add_argument("--config", required=True, help="EngineConfig as JSON")
    p.add_argument("--start-number", type=int, default=0, help="0 for the first engine, n for its n-th restart")
    args = p.parse_args(argv)
    # The serving process decides when this one stops (a Ctrl-C or a service manager's SIGTERM can
    # reach the whole process group): it drains, then closes the command pipe, so in-flight requests
    # end in order rather than by a signal here.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ev_fd = args.events
    lock = threading.Lock()

    def emit(events: list) -> None:  # one frame per step
        data = _pack([encode(e) for e in events])
        try:
            with lock:
                _write_all(ev_fd, data)
        except BrokenPipeError:  # the serving process is gone: nobody is left to serve
            loop.stop()

    from stratum.engine import builder
    from stratum.engine.encoder import make_engine

    def send(message) -> None:
        _write_all(ev_fd, _pack(encode(message)))

    send(Starting("loading model"))
    Faults.from_env().check_start(args.start_number)
    try:
        config = EngineConfig.from_json(args.config)
        checkpoint = builder.load(config)
        send(TokenizerData.of(checkpoint.tokenizer, checkpoint.chat_template))
        engine = make_engine(config, checkpoint)
    except Exception as e:  # the serving side prints this and exits
        send(StartFailed(f"{type(e).__name__}: {e}"))
        return 1
    send(engine.info())
    loop = EngineLoop(engine, emit)

    def read_commands() -> None:
        try:
            for data in _messages(args.commands):
                command = decode(data)
                if isinstance(command, Stop):
                    return
                loop.submit(command)
        finally:
            loop.stop()  # the serving process closed the pipe, or died: nothing is left to serve

    threading.Thread(target=read_commands, name="stratum-engine-commands", daemon=True).start()
    loop.run()
    return 1 if loop.death is not None else 0


if __name__ == "__main__":
    sys.exit(main())

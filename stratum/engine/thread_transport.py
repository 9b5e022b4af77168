"""The engine loop in a thread of the serving process, behind the same `EngineClient` (the offline
server, tests): commands and events cross as the records themselves."""

from __future__ import annotations

import threading

from stratum.engine.client import EngineClient, Transport
from stratum.engine.loop import EngineLoop, LoopEngine
from stratum.engine.protocol import Command


class ThreadTransport(Transport):
    def __init__(self, engine: LoopEngine):
        self.engine = engine
        self.loop: EngineLoop | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.loop = EngineLoop(self.engine, self.client.deliver)
        self.thread = threading.Thread(target=self.loop.run, name="stratum-engine", daemon=True)
        self.thread.start()

    def send(self, commands: list[Command]) -> None:
        for command in commands:
            self.loop.submit(command)

    def shutdown(self) -> None:
        self.loop.stop()
        self.thread.join(timeout=10)


def start_thread_engine(engine) -> EngineClient:
    """Run engine's loop (an `EngineCore`) in a thread of this process, behind an EngineClient."""
    transport = ThreadTransport(engine)
    client = EngineClient(engine.info(), engine.tokenizer, engine.chat_template, transport)
    transport.start()
    return client

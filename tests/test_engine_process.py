"""The engine boundary: every command and event round-trips through the one codec, a step is one
compact frame, and a request served through each local transport (the engine in a process of its
own, or in a thread) gives the same tokens as the offline engine, with the text assembled from
deltas equal to the engine's own."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import msgpack
import pytest

from stratum.engine.outputs import MetaState
from stratum.engine import (
    LLM, EngineConfig, EngineDeadError, InvalidRequestError, RequestOutput, RequestStats, SamplingParams,
)
from stratum.engine.loop import EngineLoop
from stratum.engine.thread_transport import start_thread_engine
from stratum.engine.process import EngineProcess, start_process_engine
from stratum.engine.protocol import (
    Abort, Accepted, AddRequest, EngineDied, EngineSnapshot, HeldKeys, KVBlocks, ListHeld, ReplicaDescription,
    ReplicaReport, RequestFailed, Routed, StartFailed, Started, Starting, Stop, StreamDecoder, TokenizerData, decode,
    encode,
)
from stratum.engine.request import CachePolicy


def wire(obj):
    """Through msgpack and back, as the pipe carries it."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False, strict_map_key=False)


def stats() -> RequestStats:
    return RequestStats(12, 4, 8, 0, 3, 0, 1.5, 1.6, 1.7, 1.7, 1.9, [1.7, 1.8, 1.9], 0.25, 2, 1, 4096, 0)


def test_outputs_round_trip_and_deltas_accumulate():
    decoder = StreamDecoder()
    first = RequestOutput("r", "Hel", [5, 6], "Hel", [5, 6], False, stats=stats(), state=MetaState.PREFILL_COMPLETE)
    second = RequestOutput("r", "lo", [7], "Hello", [5, 6, 7], False, state=MetaState.DECODE_STEP, state_index=2,
                           kv_cache_efficiency=0.5)
    last = RequestOutput("r", "!", [8], "Hello!", [5, 6, 7, 8], True, "stop", 2, stats(), MetaState.FINISHED, 0, 0.5)
    got = [decoder.decode(wire(encode(o))) for o in (first, second, last)]
    assert got == [first, second, last]
    assert isinstance(got[0].stats, RequestStats) and got[0].stats.token_times == [1.7, 1.8, 1.9]
    sent = decode(wire(encode(second)))  # a running output sends its deltas only
    assert sent.delta_text == "lo" and sent.text is None and sent.token_ids is None
    assert decoder._partial == {}  # forgotten once finished
    decoder.decode(wire(encode(first)))
    decoder.decode(wire(encode(RequestFailed("r", "boom", "internal"))))
    assert decoder._partial == {}  # and once failed


def test_every_message_round_trips_as_its_own_type(tiny_model_dir):
    snap = EngineSnapshot(alive=True, mode="basic", degraded_reason="x", num_running=2, num_waiting=1,
                          kv_blocks=KVBlocks(64, 10, 4, 50), num_preemptions=3, num_steps=9, overhead_ratio=0.1,
                          mean_step_s=0.02, threads=1, rss_mb=12.5)
    sampling = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=3, seed=11, stop=["\n"],
                              stop_token_ids=[2])
    add = AddRequest("r1", [1, 2, 3], sampling, priority=-1, cache_salt="tenant",
                     cache_policy=CachePolicy(pin_ttl_s=5.0),
                     tool_marker="<tool_call>", pin_prefixes=[(16, 300.0)], low_latency=True, fork_of="r0")
    messages = [snap, add, AddRequest("r2", [4], SamplingParams()), Abort("r1"), ListHeld(64), Stop(),
                Accepted("r1", 32), Started(["r1", "r2"]), RequestFailed("r1", "no", "invalid_request"),
                HeldKeys([1, 2, 3]), EngineDied("gone"), Routed("r1", "replica-a")]
    for message in messages:
        got = decode(wire(encode(message)))
        assert type(got) is type(message) and got == message
    assert isinstance(decode(wire(encode(add))).pin_prefixes[0], tuple)
    assert isinstance(RequestFailed("r", "m", "invalid_request").exception(), InvalidRequestError)
    assert isinstance(RequestFailed("r", "m", "unavailable").exception(), EngineDeadError)
    engine = LLM(str(tiny_model_dir), num_kv_blocks=32).engine
    info = engine.info()
    assert decode(wire(encode(info))) == info  # the start-up's last message, and the event after a switch of kernels
    tokenizer = TokenizerData.of(engine.tokenizer, engine.chat_template.source)
    for message in (Starting("loading model"), tokenizer, StartFailed("ModelLoadError: no such file")):
        assert decode(wire(encode(message))) == message
    # a replica's messages carry the engine's, each in its own encoding
    for message in (ReplicaDescription(4321, info, tokenizer, snap), ReplicaReport(4321, 99.5, 2, snap, [7, 8], 98.0)):
        got = decode(wire(encode(message)))
        assert type(got) is type(message) and got == message and type(got.snapshot) is EngineSnapshot
    rebuilt, template = decode(wire(encode(tokenizer))).build()
    assert rebuilt.encode("hello there") == engine.tokenizer.encode("hello there")
    assert template.source == engine.chat_template.source


def test_a_replica_sets_snapshot_adds_up_its_replicas():
    a = EngineSnapshot(alive=True, num_running=2, num_waiting=1, kv_blocks=KVBlocks(64, 10, 4, 50), num_steps=30,
                       overhead_ratio=0.1, mean_step_s=0.02, threads=1, rss_mb=100.0, step="native")
    b = EngineSnapshot(alive=True, mode="basic", degraded_reason="cache: boom", num_running=1,
                       kv_blocks=KVBlocks(64, 60, 0, 4), num_steps=10, overhead_ratio=0.5, mean_step_s=0.05, threads=1,
                       rss_mb=120.0, step="pytorch", preparing="measuring")
    dead = EngineSnapshot(alive=False, error="gone")
    total = EngineSnapshot.summed({"a": a, "b": b, "c": dead})
    assert total.alive and total.error is None and total.num_engines == 2 and total.mode == "basic"
    assert (total.num_running, total.num_waiting, total.kv_blocks) == (3, 1, KVBlocks(128, 70, 4, 54))
    assert total.overhead_ratio == pytest.approx((0.1 * 30 + 0.5 * 10) / 40) and total.mean_step_s == 0.05
    assert (total.threads, total.rss_mb, total.step) == (2, 220.0, "native+pytorch")
    assert ((total.degraded_reason, total.preparing, total.gpu_memory_allocated_mb)
            == ("b: cache: boom", "b: measuring", None))
    gone = EngineSnapshot.summed({"c": dead})
    assert not gone.alive and gone.error == "c: gone" and gone.num_engines == 0


def test_one_thread_rule_for_an_engine_and_for_replicas(monkeypatch):
    """`default_threads` is what the builder and `cluster.launch` both ask: the numbers each had before."""
    from stratum.engine.config import default_threads

    monkeypatch.delenv("STRATUM_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 9)
    assert default_threads(serving=True, native_step=True) == 9  # the native step: every core
    assert default_threads(serving=True) == 8  # the PyTorch step leaves one to the HTTP side
    assert default_threads(serving=False) == 9  # offline: nothing else runs
    assert default_threads(serving=True, replicas=2) == 4  # replicas share the cores but one
    assert default_threads(serving=True, native_step=True, replicas=16) == 1
    monkeypatch.setenv("STRATUM_NUM_THREADS", "3")
    assert default_threads(serving=True, replicas=2) == 3
    monkeypatch.setenv("STRATUM_NUM_THREADS", "-1")  # not a thread count: ignored
    assert default_threads(serving=True, replicas=2) == 4


def test_the_builder_takes_its_threads_from_the_one_rule(monkeypatch):
    """The PyTorch step's threads are `default_threads`' (the plan measures only the native step's);
    --threads, else $STRATUM_NUM_THREADS, is taken as set."""
    from stratum.engine import builder
    from stratum.engine.config import EngineConfig
    from stratum.kernels import PlanSource
    from stratum.kernels.numerics import PYTORCH, Numerics

    numerics = Numerics("m", "cpu", PYTORCH, "float32", "float32", (), "pytorch", None)
    monkeypatch.delenv("STRATUM_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 9)
    plan = builder._plan(EngineConfig(serving=True), None, numerics, measure=False)
    assert (plan.threads, plan.source) == (8, PlanSource.RULE)
    assert builder._plan(EngineConfig(), None, numerics, measure=False).threads == 9
    assert builder._plan(EngineConfig(num_threads=5), None, numerics, measure=False).source is PlanSource.CONFIGURED
    monkeypatch.setenv("STRATUM_NUM_THREADS", "3")
    plan = builder._plan(EngineConfig(serving=True), None, numerics, measure=False)
    assert (plan.threads, plan.source) == (3, PlanSource.CONFIGURED)


def test_a_step_is_one_compact_frame():
    """Every event of a step travels in one msgpack frame; a running output costs its deltas, a tag
    of one byte and its fields, not its text so far."""
    outputs = [RequestOutput(f"r{i}", " word", [1000 + i], "x" * 4000, list(range(1000)), False,
                             state=MetaState.DECODE_STEP)
               for i in range(16)]
    frame = msgpack.packb([encode(e) for e in [*outputs, EngineSnapshot(alive=True)]], use_bin_type=True)
    per_output = (len(frame) - len(msgpack.packb([encode(EngineSnapshot(alive=True))], use_bin_type=True))) / 16
    assert per_output < 64, per_output  # the 4,000 characters and 1,000 tokens so far are not sent


def test_an_aborted_request_ends_with_a_last_output(tiny_model_dir):
    """The loop emits an aborted request's last output, so the side that assembles deltas forgets it."""
    emitted: list = []
    loop = EngineLoop(LLM(str(tiny_model_dir), num_kv_blocks=32).engine, emitted.extend)
    loop.submit(AddRequest("a1", [1, 5, 9], SamplingParams(max_tokens=50, ignore_eos=True)))
    loop._once()
    loop._once()
    loop.submit(Abort("a1"))
    loop._once()
    last = [e for e in emitted if isinstance(e, RequestOutput)][-1]
    assert last.request_id == "a1" and last.finished and last.finish_reason == "abort"
    assert isinstance(emitted[-1], EngineSnapshot) and emitted[-1].kv_blocks.in_use == 0


@pytest.fixture(scope="module", params=["process", "thread"])
def engine_client(request, tiny_model_dir):
    """The engine behind each local transport."""
    if request.param == "process":
        client = start_process_engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, num_threads=1))
    else:
        client = start_thread_engine(LLM(str(tiny_model_dir), num_kv_blocks=64, num_threads=1).engine)
    yield client
    client.shutdown()


def test_each_transport_serves_what_the_offline_engine_computes(tiny_model_dir, engine_client):
    assert (engine_client.engine_pid != os.getpid()) == isinstance(engine_client.transport, EngineProcess)
    prompts = [[1, 5, 9, 13, 17], [1, 200, 201, 202, 3, 4, 5, 6, 7]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    offline = LLM(str(tiny_model_dir), num_kv_blocks=64, num_threads=1).generate(prompts, params)

    async def serve():
        async def one(i, ids):
            stream = engine_client.submit(ids, params, request_id=f"p{i}")
            deltas, last = [], None
            async for out in stream:
                deltas.append(out.delta_text)
                assert out.text == "".join(deltas)  # assembled on this side from the deltas
                last = out
                if out.finished:
                    break
            return last
        return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))

    served = asyncio.run(serve())
    for got, want in zip(served, offline):
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.stats.num_prompt_tokens == want.stats.num_prompt_tokens
    assert engine_client.snapshot.alive and engine_client.snapshot.kv_blocks.in_use == 0


def test_engine_process_exits_when_shut_down(tiny_model_dir):
    client = start_process_engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32, num_threads=1))
    pid = client.engine_pid
    client.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped: gone, not a zombie


def test_the_serving_loop_reads_the_engine_process_events_itself(tiny_model_dir):
    """Given the serving event loop, the process transport reads the event pipe on it (no thread hands
    the events over): requests are served as the offline engine computes them, and the engine's
    death is seen there too."""
    prompts = [[1, 5, 9, 13, 17], [1, 200, 201, 202, 3, 4, 5, 6, 7]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    offline = LLM(str(tiny_model_dir), num_kv_blocks=64, num_threads=1).generate(prompts, params)

    async def serve():
        loop = asyncio.get_running_loop()
        transport = EngineProcess(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, num_threads=1))
        client = await asyncio.to_thread(transport.connect, loop=loop)
        delivered_on: set[int] = set()
        deliver = client.deliver
        client.deliver = lambda events: (delivered_on.add(threading.get_ident()), deliver(events))
        try:
            async def one(i, ids):
                stream = client.submit(ids, params, request_id=f"p{i}")
                return [out async for out in stream][-1]

            served = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
            assert delivered_on == {threading.get_ident()}
            stream = client.submit(prompts[0], SamplingParams(max_tokens=1000, ignore_eos=True), request_id="long")
            await stream.next()
            os.kill(client.engine_pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async with asyncio.timeout(30):
                    async for _ in stream:
                        pass
            assert not client.snapshot.alive and "exited" in client.snapshot.error
            return served
        finally:
            client.shutdown()

    for got, want in zip(asyncio.run(serve()), offline):
        assert got.token_ids == want.token_ids and got.text == want.text

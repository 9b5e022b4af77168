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

from stratum.engine import (
    LLM, EngineConfig, EngineDeadError, InvalidRequestError, RequestOutput, RequestStats, SamplingParams,
)
from stratum.engine.client import start_thread_engine
from stratum.engine.process import EngineProcess, start_process_engine
from stratum.engine.protocol import (
    Abort, Accepted, AddRequest, EngineDied, EngineInfo, EngineSnapshot, HeldKeys, KVBlocks, ListHeld, RequestFailed,
    Routed, Started, Stop, StreamDecoder, decode, decode_info, encode, encode_info,
)
from stratum.engine.request import CachePolicy


def wire(obj):
    """Through msgpack and back, as the pipe carries it."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False, strict_map_key=False)


def stats() -> RequestStats:
    return RequestStats(12, 4, 8, 0, 3, 0, 1.5, 1.6, 1.7, 1.7, 1.9, [1.7, 1.8, 1.9], 0.25, 2, 1, 4096, 0)


def test_outputs_round_trip_and_deltas_accumulate():
    decoder = StreamDecoder()
    first = RequestOutput("r", "Hel", [5, 6], "Hel", [5, 6], False, stats=stats(), state="prefill_complete")
    second = RequestOutput("r", "lo", [7], "Hello", [5, 6, 7], False, state="decode_step_2", kv_cache_efficiency=0.5)
    last = RequestOutput("r", "!", [8], "Hello!", [5, 6, 7, 8], True, "stop", 2, stats(), "finished", 0.5)
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
    sampling = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=3, seed=11, stop=["\n"], stop_token_ids=[2])
    add = AddRequest("r1", [1, 2, 3], sampling, priority=-1, cache_salt="tenant", cache_policy=CachePolicy(pin_ttl_s=5.0),
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
    info = EngineInfo.of(LLM(str(tiny_model_dir), num_kv_blocks=32).engine)
    assert decode_info(wire(encode_info(info))) == info
    assert decode(wire(encode(info))) == info  # the event sent again after a switch of kernels


def test_a_step_is_one_compact_frame():
    """Every event of a step travels in one msgpack frame; a running output costs its deltas, a tag
    of one byte and its fields, not its text so far."""
    outputs = [RequestOutput(f"r{i}", " word", [1000 + i], "x" * 4000, list(range(1000)), False, state="decode")
               for i in range(16)]
    frame = msgpack.packb([encode(e) for e in [*outputs, EngineSnapshot(alive=True)]], use_bin_type=True)
    per_output = (len(frame) - len(msgpack.packb([encode(EngineSnapshot(alive=True))], use_bin_type=True))) / 16
    assert per_output < 64, per_output  # the 4,000 characters and 1,000 tokens so far are not sent


def test_an_aborted_request_ends_with_a_last_output(tiny_model_dir):
    """The loop emits an aborted request's last output, so the side that assembles deltas forgets it."""
    from stratum.engine.client import EngineLoop

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

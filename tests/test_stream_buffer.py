"""A request's deltas wait for a slow client in a bounded buffer
(router/routing/stream_buffer.py): while the client does not read, deltas
merge into one; past --max-stream-buffer-tokens the request is aborted at
its worker and the client gets an error, not the rest. Work is held with
hooks (step_gate.py grants the engine one step at a time), never sleeps."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from engine_hold import until
from serving import http_client, make_frontend
from step_gate import StepGate

from shoal.proto.logprobs import TokenLogprob
from shoal.proto.messages import GenerateDelta, RequestFinished, Riding
from shoal.router.routing import rebalance, replica_stats
from shoal.router.routing.failover import FailoverPool
from shoal.router.routing.stream_buffer import StreamBuffer, StreamBufferFull
from shoal.router.routing.worker_pool import ServeWorkerPool
from tests.test_delta_mux import StandInHandle
from tests.test_failover import PROMPTS, request, workers

CAP = 12


def _delta(ids, text, finished=None, lps=False):
    return GenerateDelta(list(ids), text, [TokenLogprob(t, -1.0, {}) for t in ids] if lps else None, finished)


def test_deltas_merge_while_unread_and_other_items_keep_their_order():
    async def main():
        buf = StreamBuffer(max_tokens=100)
        buf.put(_delta([1], "a", lps=True))
        buf.put(_delta([2, 3], "bc", lps=True))
        buf.put(_delta([4], "d", lps=True))
        first = await buf.get()
        buf.put(Riding("w"))
        buf.put(_delta([5], "e"))
        done = RequestFinished("stop", None, "w", 3, 0, 6, 0.0)
        buf.put(_delta([6], "f", done))
        buf.put(_delta([7], "g"))  # nothing merges into a last delta
        rest = [await buf.get() for _ in range(3)]
        return first, rest, buf

    first, rest, buf = asyncio.run(main())
    assert first.token_ids == [1, 2, 3, 4] and first.text == "abcd"
    assert [lp.token_id for lp in first.logprobs] == [1, 2, 3, 4]
    assert isinstance(rest[0], Riding)
    assert rest[1].token_ids == [5, 6] and rest[1].text == "ef" and rest[1].finished.finish_reason == "stop"
    assert rest[2].token_ids == [7]
    assert buf.num_merged == 3 and buf.num_tokens == 0 and buf.peak_tokens == 4


def test_past_the_cap_it_drops_what_it_holds_and_says_so_once():
    overflows = []
    buf = StreamBuffer(max_tokens=4, on_overflow=overflows.append)
    for t in range(4):
        buf.put(_delta([t], "x"))
    assert buf.num_tokens == 4 and not overflows
    buf.put(_delta([9, 9], "yy"))
    buf.put(_delta([10], "z"))  # after the overflow: dropped
    assert overflows == [6] and buf.overflowed and buf.peak_tokens == 4
    got = asyncio.run(buf.get())
    assert isinstance(got, StreamBufferFull) and "--max-stream-buffer-tokens 4" in str(got)
    assert not buf._items


@pytest.fixture(autouse=True)
def _no_rebalancer(monkeypatch):
    monkeypatch.setattr(rebalance, "start", lambda handle: None)
    yield
    replica_stats.REGISTRY.replicas.clear()


@pytest.mark.parametrize("riding", [False, True], ids=["own-stream", "riding"])
def test_a_client_that_stops_reading_is_bounded_then_aborted_at_its_worker(tiny_model, riding, caplog):
    caplog.set_level(logging.WARNING, logger="shoal.router.routing.worker_pool")

    async def main():
        async with workers(tiny_model, n=1) as ws:
            w = ws[0]
            serve = ServeWorkerPool(StandInHandle(ws), "router-s", max_buffer_tokens=CAP)
            pool = FailoverPool(serve)
            if riding:  # a first request opens this router's delta stream at the worker
                async for _ in pool.generate(request(ws, PROMPTS[0], "warm", temperature=0, max_tokens=2)):
                    pass
                assert await until(lambda: serve.mux.router_id in w._outboxes) < 10
            inboxes = []
            open_ = serve.mux.open
            serve.mux.open = lambda rid, cb=None: inboxes.append(open_(rid, cb)) or inboxes[-1]
            gate = StepGate(w)
            try:
                req = request(ws, PROMPTS[1], "slow", temperature=0, max_tokens=400, ignore_eos=True)
                stream = pool.generate(req)
                reader = asyncio.ensure_future(anext(stream))
                eng = w.engine.engine
                while not reader.done():  # a step at a time until the first token is read
                    steps = eng.num_steps
                    gate.grant()
                    await until(lambda: reader.done() or eng.num_steps > steps)
                    await until(reader.done, 0.2)  # (else one more step: a token more in the buffer)
                first = await reader
                # The client reads no more: each step's delta waits, merged with those before it.
                (buf,) = inboxes
                waiting = []
                while not buf.overflowed:
                    before = buf.num_tokens
                    gate.grant()
                    assert await until(lambda: buf.num_tokens > before or buf.overflowed) < 10
                    waiting.append(buf.num_tokens)
                gone = await until(lambda: "slow" not in w.engine._queues and not w.engine.engine.requests)
                free = w.stats().num_free_blocks == w.stats().num_total_blocks
                with pytest.raises(StreamBufferFull) as err:
                    await anext(stream)
                await stream.aclose()
            finally:
                gate.remove()
            return first, buf, waiting, gone, free, err.value, pool.num_failovers, serve.mux.num_request_entries

    first, buf, waiting, gone, free, err, failovers, entries = asyncio.run(main())
    assert len(first.token_ids) >= 1
    # One delta a step, merged while unread: it held at most CAP tokens, then dropped them.
    assert CAP - 2 <= max(waiting[:-1]) <= CAP and waiting[-1] == 0
    assert buf.peak_tokens <= CAP and buf.num_merged >= CAP - 3
    assert gone < 10 and free, "the worker went on with a request nobody reads"
    assert "--max-stream-buffer-tokens" in str(err)
    assert failovers == 0 and entries == 0
    assert any("slow" in r.getMessage() and "aborted" in r.getMessage() for r in caplog.records)


class _AbortedPool:
    """A pool whose stream's client was too slow: a delta, then StreamBufferFull."""

    async def generate(self, request):
        yield GenerateDelta([5], "a")
        raise StreamBufferFull("the client read none of the last 13 tokens (--max-stream-buffer-tokens 12)")


def test_the_client_gets_an_error_event_and_the_end_of_the_stream(tiny_model):
    async def main():
        fe = make_frontend(tiny_model)
        fe.pool = _AbortedPool()
        async with http_client(fe) as c:
            r = await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 50, "stream": True})
        return r, fe.num_in_flight

    r, in_flight = asyncio.run(main())
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "stream_buffer_full" and "--max-stream-buffer-tokens" in err["message"]
    assert in_flight == 0

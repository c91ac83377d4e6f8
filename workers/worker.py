"""One worker: an AsyncEngine behind the methods a router calls.

The cluster deploys this class as a Ray Serve deployment, one replica per GPU
(or per CPU worker here); tests also run it in-process. It speaks the
dataclasses of proto/messages.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict

from shoal.proto import replica_logs, tracing
from shoal.proto.errors import (
    EngineDeadError,
    InvalidRequestError,
    RequestFailedError,
    RequestMoved,
)
from shoal.proto.kv_events import KVEventBatch
from shoal.proto.lora.modules import parse_lora_modules
from shoal.proto.lora.registry import LoRARegistry, serve_app_registry
from shoal.proto.messages import (
    GenerateDelta,
    GenerateRequest,
    RequestFinished,
    Riding,
    Subscribe,
    WorkerError,
    WorkerInfo,
    WorkerLoad,
)
from shoal.workers.async_engine import AsyncEngine
from shoal.workers.core.outputs import RequestOutput
from shoal.workers.delta_outbox import DeltaOutbox
from shoal.workers.engine_args import EngineArgs
from shoal.workers.kv_transfer import cluster_tier
from shoal.workers.lora.worker_adapters import WorkerAdapters

logger = logging.getLogger(__name__)
_local_ids = itertools.count()


def _worker_name() -> str:
    serve = sys.modules.get("ray.serve")  # imported already inside a Serve replica
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica
        return f"local-{next(_local_ids)}"


class Worker:
    """generate() streams deltas of one request; stats() and info() describe
    the worker. A request past `max_waiting` waiting ones is refused at once
    (the router answers 429) so that admitted ones keep their pace. An
    engine loop that makes no progress for `stall_timeout_s` while it has
    work (0: never) makes the worker dead: see check_health. The adapters
    loaded at run time come from `lora_registry` (inside Serve: the
    application's, in Ray's GCS): those there at start, and any a request
    names that is not loaded here yet. An adapter that cannot be loaded
    here leaves the worker up without it (workers/lora/worker_adapters.py)."""

    def __init__(
        self,
        engine_args: EngineArgs,
        max_waiting: int,
        stall_timeout_s: float = 0.0,
        lora_registry: LoRARegistry | None = None,
        kv_store=None,
    ):
        """kv_store: the handle of the application's KVStore deployment
        (--kv-cluster-tier object-store), the cluster tier's index."""
        if kv_store is not None:  # before the engine's connector looks for it
            cluster_tier.use_store_handle(kv_store, _running_loop())
        replica_logs.use_serve_handlers()  # the per-request lines below reach Serve's logs
        self.name = _worker_name()
        tracing.configure("shoal-worker")  # on only when OTEL_* asks for it
        lora_modules = parse_lora_modules(engine_args.lora_modules) if engine_args.enable_lora else []
        if lora_modules:  # loaded below, each on its own: one unreadable adapter must not stop the start
            engine_args = dataclasses.replace(engine_args, lora_modules=None)
        self.engine = AsyncEngine.from_engine_args(engine_args, stall_timeout_s)
        self.max_waiting = max_waiting
        self._outboxes: dict[str, DeltaOutbox] = {}  # router id -> its delta stream here
        eng = self.engine.engine
        logger.info("worker %s loaded %s in %.1f s", self.name, eng.model_name, eng.load_time_s)
        self.lora_registry = None
        if engine_args.enable_lora:
            self.lora_registry = lora_registry if lora_registry is not None else serve_app_registry()
        self.loras = WorkerAdapters(
            self.engine, self.name, engine_args.lora_root, engine_args.max_runtime_loras, self.lora_registry
        )
        self.loras.start(lora_modules)

    def info(self) -> WorkerInfo:
        eng = self.engine.engine
        return WorkerInfo(
            eng.model_name,
            eng.max_model_len,
            eng.model_config.vocab_size,
            eng.block_manager.block_size,
            eng.args.tensor_parallel_size,
            self.name,
            eng.limits.max_logprobs,
            eng.limits.max_stop_strings,
            eng.limits.max_n,
            eng.args.grammar_compile_timeout_s,
            eng.args.enable_lora,
            eng.args.max_loras if eng.args.enable_lora else 0,
            self.loras.ids(),
            max_logit_bias=eng.limits.max_logit_bias,
        )

    def stats(self) -> WorkerLoad:
        load = WorkerLoad(**asdict(self.engine.stats()), worker=self.name, time=time.time())
        load.num_waiting = self.engine.num_waiting  # counting requests added since the engine's last step
        loras, load.running_lora_adapters, load.waiting_lora_adapters = self.engine.engine.lora_stats()
        load.loras = self.loras.where(loras)
        load.kv_tiers = {tier: asdict(t) for tier, t in self.engine.engine.kv_tier_stats().items()}
        load.prefill_us_per_token = self.engine.engine.prefill_us_per_token
        return load

    def check_health(self) -> None:
        """Ray Serve's health check: a failed or stalled engine loop, or a
        dead tensor-parallel rank, fails the replica (Serve then replaces it
        and its placement group, all ranks together). Its requests end at
        once as 'unavailable', and the router fails them over."""
        self.engine.check_health()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta | Riding | WorkerError]:
        """Yields the request's deltas, or one WorkerError if it is refused
        or, amid the deltas, if the engine died ('unavailable': the router
        sends the request on to another worker). When its router's delta
        stream is open here (subscribe), the deltas go there instead and
        this stream yields Riding first. Logs one line per request (ids and
        counts, never its text)."""
        name = request.log_name
        if self.engine.failed is not None:  # refused, not taken: the router may send it on at no cost
            yield WorkerError("unavailable", f"worker {self.name}: the engine is dead: {self.engine.failed}")
            return
        if self.engine.num_waiting >= self.max_waiting:
            logger.info("%s refused: %d requests waiting", name, self.max_waiting)
            yield WorkerError("full", f"worker {self.name} has {self.max_waiting} requests waiting; try again later")
            return
        lora = None
        if request.lora_name is not None:
            lora = await self.loras.for_request(request.lora_name)
            if isinstance(lora, WorkerError):  # unloaded since the router chose this worker, or not loadable here
                logger.info("%s refused: LoRA adapter %r: %s", name, request.lora_name, lora.message)
                yield lora
                return
        logged, num_output_tokens = False, 0
        attrs = {"shoal.worker": self.name, "shoal.resumed_tokens": request.num_resumed_tokens}
        if lora is not None:
            attrs |= {"gen_ai.request.model": lora.lora_name, "shoal.lora": lora.lora_int_id}
        span = tracing.start_worker_span(request.trace_context, request.request_id, attrs)
        box = self._outboxes.get(request.mux) if request.mux is not None else None
        if box is not None:  # the whole request rides there: its deltas keep their order
            box.join()
        try:
            if box is not None:
                yield Riding(self.name)
            stream = self.engine.generate(request)  # on whole: the engine reads what it needs
            async with aclosing(stream):
                async for out in stream:
                    delta = self._delta(out)
                    num_output_tokens = out.num_output_tokens
                    if (f := delta.finished) is not None:
                        logger.info(
                            "%s finished: %s, %d prompt + %d output tokens, queue %.2f s",
                            name,
                            f.finish_reason,
                            f.num_prompt_tokens,
                            f.num_output_tokens,
                            f.queue_s,
                        )
                        logged = True
                        if span is not None:
                            tracing.finish_worker_span(span, out.timings, f)
                    if box is None:
                        yield delta
                    elif not box.closed:
                        box.put(request.request_id, delta)
                    else:  # the router closed its stream: it reads this request no more (aclosing aborts it)
                        return
        except InvalidRequestError as e:
            logger.info("%s refused: %s", name, e)
            logged = True
            tracing.fail_span(span, e, "invalid")
            yield WorkerError("invalid", str(e), e.field)
        except EngineDeadError as e:
            # 'died': the engine died while it held the request; the router
            # counts such deaths, and a request on two of them is poisoned.
            logger.warning("%s ended by a dead engine after %d output tokens: %s", name, num_output_tokens, e)
            logged = True
            tracing.fail_span(span, e, "unavailable")
            yield WorkerError("died", f"worker {self.name}: {e}")
        except RequestFailedError as e:  # this request alone failed in the engine; the others went on
            logger.warning("%s failed: %s", name, e)
            logged = True
            tracing.fail_span(span, e, "failed")
            yield WorkerError("failed", str(e))
        except RequestMoved as e:  # handed back by release_waiting: the router sends it on
            logged = True
            tracing.fail_span(span, e, "moved")
            yield WorkerError("moved", f"worker {self.name}: {e}")
        finally:
            tracing.end_span(span)  # the client went away: end it where it stopped
            if box is not None:
                box.leave()
            if not logged:  # the client went away, or the engine failed
                logger.info("%s stopped after %d output tokens", name, num_output_tokens)

    async def subscribe(self, sub: Subscribe) -> AsyncIterator[list[tuple[str, GenerateDelta]]]:
        """A router's delta stream (workers/delta_outbox.py): an empty list
        once connected, then a list of (request id, delta) per engine step
        for the router's requests riding here. Ends when the router has had
        nothing here for a while, or at once if it was meant for another
        replica (Serve may hand a request any replica)."""
        if sub.replica != self.name:
            return
        box = DeltaOutbox()
        old = self._outboxes.get(sub.router)
        if old is not None:  # a second stream from the same router replaces the first
            old.closed = True
        self._outboxes[sub.router] = box
        try:
            async for batch in box.batches():
                yield batch
        finally:
            box.closed = True
            if self._outboxes.get(sub.router) is box:
                del self._outboxes[sub.router]

    async def kv_events(self, sub: Subscribe, after: int = 0) -> AsyncIterator[list[KVEventBatch]]:
        """The engine's KV events (--enable-kv-cache-events) after batch
        number `after`, then as they come: a list of batches (one per engine
        step that changed the cache or its tiers) each time there are new
        ones, until the subscriber goes. `sub` names this replica, as a
        delta stream's does (Serve may hand the call any replica: another's
        ends at once). A subscriber that fell too far behind gets an
        AllBlocksCleared first (core/kv_event_log.py)."""
        if sub.replica != self.name:
            return
        log = self.engine.engine.kv_events
        if log is None:
            raise ValueError(f"worker {self.name}: KV cache events are off (--enable-kv-cache-events)")
        while True:
            batches = log.since(after)
            if batches:
                after = batches[-1].seq
                yield batches
            await asyncio.sleep(self.KV_EVENTS_POLL_S)

    def _delta(self, out: RequestOutput) -> GenerateDelta:
        finished = None
        if out.finished:
            t = out.timings
            finished = RequestFinished(
                out.finish_reason,
                out.stop_reason,
                self.name,
                out.num_prompt_tokens,
                out.num_cached_tokens,
                out.num_output_tokens,
                (t.first_scheduled - t.arrival) if t and t.first_scheduled else 0.0,
            )
            if t and t.first_token:
                finished.prefill_s = t.first_token - (t.first_scheduled or t.first_token)
                finished.decode_s = (t.finished or time.time()) - t.first_token
        # The load rides on a request's first delta (which ends the router's
        # optimistic count of it) and last, and on every delta of a step due to carry it.
        first = len(out.new_token_ids) == out.num_output_tokens
        load = self._step_load(force=first or out.finished)
        return GenerateDelta(out.new_token_ids, out.new_text, out.logprobs, finished, load)

    # ---- figures for the request router (router/routing/replica_stats.py) -----------

    # Up to this many cached chain hashes go into each routing-stats report.
    ROUTING_HASHES = 1024
    # How often a KV-event subscription looks for new events (an engine step is ~10-100 ms).
    KV_EVENTS_POLL_S = 0.02
    # The load rides on the deltas of a step at most this often (each router
    # with a stream here so sees it at least as often, a step later): it
    # doubles a delta's pickled size, and a router needs it ~100 ms fresh.
    LOAD_EVERY_S = 0.04
    _load_step, _load, _load_rides, _load_sent_at = -1, None, False, 0.0
    _routing_key, _routing_stats = None, None

    def _step_load(self, force: bool = False) -> WorkerLoad | None:
        """The load as of the engine's latest step, read once per step and
        shared by every delta of it; None on the deltas of a step that is
        not due to carry it (unless forced)."""
        step = self.engine.engine.num_steps
        if step != self._load_step or self._load is None:
            self._load, self._load_step = self.stats(), step
            now = time.monotonic()
            self._load_rides = now - self._load_sent_at >= self.LOAD_EVERY_S
            if self._load_rides:
                self._load_sent_at = now
        return self._load if self._load_rides or force else None

    def record_routing_stats(self) -> dict:
        """Serve's poll for the request router (each request_routing_stats_period_s):
        the load (the deltas' WorkerLoad, as a dict: Serve wants one), the MRU
        cached chain hashes and those its host and disk KV tiers hold. Figures unchanged since the last poll return the
        same dict, so an idle worker sets off no broadcast."""
        load = self.stats()
        key = (
            self.engine.engine.num_steps,
            load.num_free_blocks,
            load.num_running,
            load.num_waiting,
            load.num_waiting_tokens,
            tuple(load.loras.items()),
        )
        if key != self._routing_key:
            engine = self.engine.engine
            cached = engine.block_manager.pool.cached_hashes_mru(self.ROUTING_HASHES)
            # ...and those its host and disk tiers hold (kv_transfer/): a hit there is a fetch, not a prefill
            offloaded = engine.kv_connector.offloaded_hashes(self.ROUTING_HASHES) if engine.kv_connector else []
            self._routing_key = key
            self._routing_stats = asdict(load) | {"cached": cached, "offloaded": offloaded}
        return self._routing_stats

    # ---- LoRA adapters loaded and unloaded at run time (the router's /v1/load_lora_adapter)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, lora_int_id: int) -> WorkerError | None:
        """Serve a peft adapter from lora_path as lora_name: None when done (or
        loaded here already under this id), else a WorkerError (WorkerAdapters.load)."""
        return await self.loras.load(lora_name, lora_path, lora_int_id)

    def num_lora_requests(self, lora_name: str) -> int:
        """Requests here under the adapter, from their arrival to their end."""
        return self.engine.num_lora_requests(lora_name)

    def unload_lora_adapter(self, lora_name: str) -> WorkerError | None:
        """Stop serving lora_name. None when done; a WorkerError 'not_found',
        or 'conflict' while requests under it are here (it stays loaded)."""
        return self.loras.unload(lora_name)

    # ---- autoscaling (cluster/autoscaling.py) and rebalancing (router/routing/rebalance.py)

    def record_autoscaling_stats(self) -> dict:
        """Serve's autoscaling metrics, sampled on the replica and pushed to
        the controller every metrics_interval_s, where the Worker
        deployment's policy reads them: waiting and running requests, the
        share of KV blocks in use, and how many sequences can run at once."""
        load = self.stats()
        used = 1.0 - load.num_free_blocks / load.num_total_blocks if load.num_total_blocks else 0.0
        return {
            "waiting": float(load.num_waiting),
            "running": float(load.num_running),
            "kv_usage": used,
            "max_running": float(self.engine.engine.scheduler.config.max_num_seqs),
        }

    def release_waiting(self, keep: dict[str, int]) -> int:
        """A router's call (to every worker) when a new worker is ready:
        this worker keeps `keep[its name]` waiting requests and hands back
        the newest of the rest that never ran; their streams end with
        WorkerError 'moved' and the router sends them on. Returns how many."""
        if self.name not in keep or self.engine.failed is not None:
            return 0
        moved = self.engine.release_waiting(keep[self.name])
        if moved:
            logger.info("handed back %d waiting requests to move (keeping %d)", len(moved), keep[self.name])
        return len(moved)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The replica's event loop, when its constructor runs on it (Serve's one-loop replicas)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None

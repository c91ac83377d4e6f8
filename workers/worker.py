"""One worker: an AsyncEngine behind the methods a router calls.

The cluster deploys this class as a Ray Serve deployment, one replica per GPU
(or per CPU worker here); tests also run it in-process. It speaks the
dataclasses of workers/messages.py.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict

from shoal.workers.async_engine import AsyncEngine
from shoal.workers.engine_args import EngineArgs
from shoal.workers.errors import InvalidRequestError
from shoal.workers.messages import (GenerateDelta, GenerateRequest, RequestFinished, WorkerError, WorkerInfo,
                                    WorkerLoad)  # fmt: skip
from shoal.workers.core.outputs import RequestOutput

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
    (the router answers 429) so that admitted ones keep their pace."""

    def __init__(self, engine_args: EngineArgs, max_waiting: int):
        self.name = _worker_name()
        self.engine = AsyncEngine.from_engine_args(engine_args)
        self.max_waiting = max_waiting
        eng = self.engine.engine
        logger.info("worker %s loaded %s in %.1f s", self.name, eng.model_name, eng.load_time_s)

    def info(self) -> WorkerInfo:
        eng = self.engine.engine
        return WorkerInfo(eng.model_name, eng.max_model_len, eng.model_config.vocab_size,
                          eng.block_manager.block_size, eng.args.tensor_parallel_size, self.name)  # fmt: skip

    def stats(self) -> WorkerLoad:
        load = WorkerLoad(**asdict(self.engine.stats()), worker=self.name)
        load.num_waiting = self.engine.num_waiting  # counting requests added since the engine's last step
        return load

    def check_health(self) -> None:
        """Ray Serve's health check: a failed engine loop, or a dead
        tensor-parallel rank, fails the replica (Serve then replaces it and
        its placement group, all ranks together)."""
        if self.engine.failed is not None:
            raise RuntimeError(f"engine loop failed: {self.engine.failed!r}")
        self.engine.engine.check_health()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta | WorkerError]:
        """Yields the request's deltas, or one WorkerError if it is refused.
        Logs one line per request (ids and counts, never its text)."""
        name = request.log_name
        if self.engine.num_waiting >= self.max_waiting:
            logger.info("%s refused: %d requests waiting", name, self.max_waiting)
            yield WorkerError("full", f"worker {self.name} has {self.max_waiting} requests waiting; try again later")
            return
        logged, num_output_tokens = False, 0
        try:
            stream = self.engine.generate(request.request_id, request.prompt_token_ids, request.params,
                                          request.priority)  # fmt: skip
            async for out in stream:
                delta = self._delta(out)
                num_output_tokens = out.num_output_tokens
                if (f := delta.finished) is not None:
                    logger.info("%s finished: %s, %d prompt + %d output tokens, queue %.2f s", name, f.finish_reason,
                                f.num_prompt_tokens, f.num_output_tokens, f.queue_s)  # fmt: skip
                    logged = True
                yield delta
        except InvalidRequestError as e:
            logger.info("%s refused: %s", name, e)
            logged = True
            yield WorkerError("invalid", str(e), e.field)
        finally:
            if not logged:  # the client went away, or the engine failed
                logger.info("%s stopped after %d output tokens", name, num_output_tokens)

    def _delta(self, out: RequestOutput) -> GenerateDelta:
        finished = None
        if out.finished:
            t = out.timings
            finished = RequestFinished(out.finish_reason, out.stop_reason, self.name, out.num_prompt_tokens,
                                       out.num_cached_tokens, out.num_output_tokens,
                                       (t.first_scheduled - t.arrival) if t and t.first_scheduled else 0.0)  # fmt: skip
        return GenerateDelta(out.new_token_ids, out.new_text, out.logprobs, finished)

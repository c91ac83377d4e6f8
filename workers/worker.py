"""One worker: an AsyncEngine behind the methods a router calls.

The cluster deploys this class as a Ray Serve deployment, one replica per GPU
(or per CPU worker here); tests also run it in-process. Messages are plain
dicts so that they cross Ray cheaply and the router needs nothing but them.
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
from shoal.workers.core.outputs import RequestOutput
from shoal.workers.core.sampling_params import SamplingParams

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

    def __init__(self, engine_args: EngineArgs | dict, max_waiting: int = 256):
        if isinstance(engine_args, dict):
            engine_args = EngineArgs(**engine_args)
        self.name = _worker_name()
        self.engine = AsyncEngine.from_engine_args(engine_args)
        self.max_waiting = max_waiting
        eng = self.engine.engine
        logger.info("worker %s loaded %s in %.1f s", self.name, eng.model_name, eng.load_time_s)

    def info(self) -> dict:
        eng = self.engine.engine
        return {"model": eng.model_name, "max_model_len": eng.max_model_len,
                "vocab_size": eng.model_config.vocab_size, "block_size": eng.block_manager.block_size,
                "tensor_parallel_size": eng.args.tensor_parallel_size, "worker": self.name}  # fmt: skip

    def stats(self) -> dict:
        s = asdict(self.engine.stats())
        s["num_waiting"] = self.engine.num_waiting
        s["worker"] = self.name
        return s

    def record_routing_stats(self) -> dict:
        """Ray Serve polls this for its request router (routing on free KV
        blocks comes with the load-aware router)."""
        return self.stats()

    def check_health(self) -> None:
        """Ray Serve's health check: a failed engine loop, or a dead
        tensor-parallel rank, fails the replica (Serve then replaces it and
        its placement group, all ranks together)."""
        if self.engine.failed is not None:
            raise RuntimeError(f"engine loop failed: {self.engine.failed!r}")
        self.engine.engine.check_health()

    async def generate(self, request: dict) -> AsyncIterator[dict]:
        """request: request_id, prompt_token_ids, params (SamplingParams), priority.
        Yields delta dicts; a refused request yields one {"error": ...} dict."""
        if self.engine.num_waiting >= self.max_waiting:
            yield {"error": "full", "message": f"worker {self.name} has {self.max_waiting} requests waiting; "
                                               "try again later"}  # fmt: skip
            return
        params: SamplingParams = request["params"]
        try:
            stream = self.engine.generate(request["request_id"], request["prompt_token_ids"], params,
                                          request.get("priority", 0))  # fmt: skip
            async for out in stream:
                yield self._message(out)
        except InvalidRequestError as e:
            yield {"error": "invalid", "message": str(e), "field": e.field}

    def _message(self, out: RequestOutput) -> dict:
        msg = {"token_ids": out.new_token_ids, "text": out.new_text}
        if out.logprobs is not None:
            msg["logprobs"] = [(lp.token_id, lp.logprob, lp.top_logprobs) for lp in out.logprobs]
        if out.finished:
            t = out.timings
            msg.update(finish_reason=out.finish_reason, stop_reason=out.stop_reason, worker=self.name,
                       num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                       num_output_tokens=out.num_output_tokens,
                       queue_s=(t.first_scheduled - t.arrival) if t and t.first_scheduled else 0.0)  # fmt: skip
        return msg

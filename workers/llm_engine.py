"""The synchronous engine: requests in, one scheduled step at a time, deltas out.

It keeps the scheduler, the requests and their outputs; the ranks that run
the model sit behind its executor (model_executor/executor/), one in this
process or, under tensor parallelism, Ray actors beside it."""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import random
import time
from collections.abc import Container
from dataclasses import dataclass
from typing import cast

import torch

from shoal.proto.block_hash import adopt_chain, check_cache_salt, lora_extra
from shoal.proto.dynamo_hash import check_available as check_dynamo_hashes
from shoal.proto.errors import EngineFaultError, InvalidRequestError, LoRAAdapterError
from shoal.proto.logprobs import TokenLogprob
from shoal.proto.lora.modules import LORA_IN_HOST, LORA_ON_DEVICE, LORA_ON_DISK, parse_lora_modules
from shoal.proto.lora.request import LoRARequest
from shoal.proto.messages import GenerateRequest
from shoal.proto.request_checks import RequestLimits, check_request, check_request_id
from shoal.proto.sampling_params import SamplingParams
from shoal.proto.stats import EngineStats
from shoal.workers.core.block_manager import BlockManager
from shoal.workers.core.kv_event_log import KVEventLog
from shoal.workers.core.lora_slots import LoRASlotTable
from shoal.workers.core.outputs import RequestOutput
from shoal.workers.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from shoal.workers.core.sequence import Sequence, SequenceStatus
from shoal.workers.engine_args import EngineArgs
from shoal.workers.kv_transfer.base import KVConnectorBase, KVConnectorRole, KVLoadError
from shoal.workers.kv_transfer.factory import connector_class, connector_name, kv_cache_spec, make_connector
from shoal.workers.lora.peft_adapter import read_lora_adapter
from shoal.workers.model_executor.executor.abstract import Executor, get_executor_class
from shoal.workers.model_executor.loader.detokenizer import IncrementalDetokenizer
from shoal.workers.model_executor.loader.model_loader import load_model_files
from shoal.workers.model_executor.platforms.cpu.openmp import release_thread_team
from shoal.workers.model_executor.runner.cuda_graph import CaptureStats
from shoal.workers.model_executor.runner.interface import PreparingRunner, Runner
from shoal.workers.profiling import step_range
from shoal.workers.step_pipeline import InFlight, StepPipeline
from shoal.workers.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)
KV_LOAD_WAIT_S = 0.05  # an idle engine's wait for a KV load to land, before it looks at new arrivals again
# Steps of at least this many tokens measure what a prefilled token costs (prefill_us_per_token),
# smoothed with this weight for the newest: fewer are decode-bound, their time mostly the weights'.
PREFILL_SAMPLE_TOKENS = 64
PREFILL_EWMA = 0.2


def _ahead_safe(seq: Sequence) -> bool:
    """Whether seq's next step may be staged before its pending token is
    known (async scheduling): not where sampling reads its tokens (a grammar,
    the penalties)."""
    p = seq.params
    return (
        seq.structured_output_request is None
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
    )


def is_engine_fault(error: BaseException, device: torch.device) -> bool:
    """Whether a step's error is beyond any one request: on CUDA an error
    of the device (a device-side assert leaves the context unusable, so
    even a probe must not run), or an EngineFaultError anywhere."""
    if isinstance(error, EngineFaultError):
        return True
    if device.type != "cuda":
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return (accelerator_error is not None and isinstance(error, accelerator_error)) or "CUDA" in str(error)


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer | None


@dataclass(slots=True)
class PendingOutput:
    """A delta whose text is made later, off the engine-core thread (async
    scheduling): the request's detokenizer advances by `token` there, while
    the core thread already runs the next step. Only requests without stop
    strings are deferred (a stop string decides the step's state), and all of
    such a request's text is made there, in step order, so its detokenizer
    has one thread."""

    out: RequestOutput  # every field final but new_text
    detok: IncrementalDetokenizer
    token: int | None  # None: nothing to add (an abort's last delta)

    @property
    def request_id(self) -> str:
        return self.out.request_id

    def resolve(self) -> RequestOutput:
        if self.token is not None:
            self.detok.add(self.token, False)
        self.out.new_text = self.detok.take(self.out.finished)
        return self.out


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs):
        args = args or EngineArgs(**kwargs)
        t0 = time.perf_counter()
        if args.load_format == "simulated" and args.tensor_parallel_size > 1:
            raise ValueError("load_format 'simulated' runs one rank: tensor_parallel_size must be 1")
        if args.structured_outputs_backend == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
            raise ValueError("structured_outputs_backend 'xgrammar' needs the xgrammar package: pip install xgrammar")
        if args.enable_lora:
            _check_lora_args(args)
        if connector_name(args) is not None:
            _check_kv_connector_args(args)
        if args.kv_events_block_hash not in ("shoal", "dynamo"):
            raise ValueError(f"kv_events_block_hash must be 'shoal' or 'dynamo'; got {args.kv_events_block_hash!r}")
        if args.enable_kv_cache_events and args.kv_events_block_hash == "dynamo":
            check_dynamo_hashes()
        loaded = load_model_files(args.model)  # config and tokenizer now; rank 0 reads the weights as it builds
        cfg = loaded.config
        self.model_name, self.model_config, self.tokenizer = loaded.name, cfg, loaded.tokenizer
        max_len = args.max_model_len or cfg.max_position_embeddings  # every backend applies sliding windows
        self.max_model_len = max_len
        self.limits = RequestLimits(
            cfg.vocab_size, max_len, args.max_logprobs, args.max_stop_strings, args.max_n, args.max_logit_bias
        )
        self.eos_token_ids = list(cfg.eos_token_ids)
        self.args = args
        cfg.check_tp_size(args.tensor_parallel_size, args.enable_expert_parallel)  # before any actor starts
        if args.enable_expert_parallel and not cfg.num_experts:
            logger.info("enable_expert_parallel ignored: %s has no experts (plain tensor parallelism)", self.model_name)
        # Every rank's device up and model loaded (a constructor that fails stops what it started).
        self.model_executor: Executor = get_executor_class(args)(args, loaded, max_len)
        try:
            num_blocks = self.model_executor.determine_num_available_blocks()
            self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
            # KV events (--enable-kv-cache-events): each step's, numbered, for subscribers (Worker.kv_events).
            self.kv_events: KVEventLog | None = None
            if args.enable_kv_cache_events:
                self.kv_events, self.block_manager.pool.events = KVEventLog(), []
                if args.kv_events_block_hash == "dynamo":
                    self.block_manager.pool.dynamo = {}
            # The KV connector's scheduler side (kv_transfer/); each rank makes its worker side.
            self.kv_connector = self._make_kv_connector(cfg) if connector_name(args) is not None else None
            self.scheduler = Scheduler(
                SchedulerConfig(
                    args.max_num_batched_tokens,
                    args.max_num_seqs,
                    args.long_prefill_token_threshold,
                    args.max_num_partial_prefills,
                    args.max_long_partial_prefills,
                ),
                self.block_manager,
                max_len,
                self.eos_token_ids,
                LoRASlotTable(args.max_loras) if args.enable_lora else None,
                self.kv_connector,
            )
            self.model_executor.initialize_cache(num_blocks)
        except BaseException:
            self.shutdown()
            raise
        self.device = self.model_executor.driver_worker.device
        self.structured_output = None  # compiles request grammars and makes each step's token masks
        if self.tokenizer is not None:
            self.structured_output = StructuredOutputManager(
                self._grammar_backend, compile_timeout_s=args.grammar_compile_timeout_s
            )
        self.requests: dict[str, _Request] = {}
        self.lora_requests: dict[int, LoRARequest] = {}  # adapters checked and registered, by id
        # Their checked tensors, the only source of a slot's fill (rank 0's manager holds them).
        self.lora_host = self.runner.lora_manager.host if args.enable_lora else None
        self.lora_by_name: dict[str, LoRARequest] = {}  # those served by name (--lora-modules, runtime loads)
        try:
            for module in parse_lora_modules(args.lora_modules):
                try:
                    self.add_named_lora(module.lora_request())
                except InvalidRequestError as e:
                    raise ValueError(f"lora_modules: adapter {module.name!r}: {e}") from None
        except BaseException:
            self.shutdown()
            raise
        self._arrivals = itertools.count()
        self._rng = random.Random(args.seed)
        self.num_steps, self.step_seconds = 0, 0.0  # model steps run, and their wall time
        # What a token of prefill costs here, measured (0.0: not yet): the router weighs a KV
        # tier's fetch of a block against it (router/routing/policies/kv.py).
        self.prefill_us_per_token = 0.0
        # Set by AsyncEngine under --async-scheduling: step() and abort_request() return
        # PendingOutput for requests without stop strings, whose text its output thread makes.
        self.defer_outputs = False
        # --async-scheduling: each step computes on a thread of its own while the next is scheduled
        # (step_pipeline.py). One rank only: the other ranks' inputs are sent from the sequences.
        self.pipeline: StepPipeline | None = None
        if args.async_scheduling:
            if args.tensor_parallel_size > 1 or self.kv_connector is not None:
                logger.info(
                    "async scheduling: steps are scheduled one after another (tensor parallelism or a KV connector)"
                )
            else:
                self.pipeline = StepPipeline(cast(PreparingRunner, self.runner))
        self.num_prompt_tokens = self.num_generation_tokens = self.num_finished_requests = 0
        # The steps may run on another thread (AsyncEngine's engine core): this one's
        # OpenMP team, made by loading and warm-up, must not outlive its work (openmp.py).
        release_thread_team()
        self.load_time_s = time.perf_counter() - t0

    def _make_kv_connector(self, cfg) -> KVConnectorBase:
        """The scheduler side, keying blocks under this engine's fingerprint (kv_transfer/keys.py)."""
        args, worker = self.args, self.model_executor.driver_worker
        spec = kv_cache_spec(
            cfg, args.block_size, worker.kv_cache_dtype, args.tensor_parallel_size, worker.kv_fingerprint()
        )
        return cast(KVConnectorBase, make_connector(args, KVConnectorRole.SCHEDULER, spec))

    def _flush_kv_moves(self) -> None:
        """The connector's moves gathered outside a schedule (a finished or
        aborted request's disk writes), made now in a pass of their own,
        before the pool can hand the blocks out again."""
        if self.kv_connector is None:
            return
        meta = self.kv_connector.build_connector_meta(None)
        if not meta.is_empty:
            out = self._execute(SchedulerOutput(kv_connector_metadata=meta))
            self.scheduler.update_from_kv_output(out.kv_connector_output)

    def _poll_kv_loads(self) -> None:
        """Loads in flight across steps (a connector's asynchronous tier): a
        pass that writes those that landed, so their requests join this
        step. With nothing else to run it waits a little for one to land,
        rather than spin the engine thread against the fetch."""
        sched = self.scheduler
        idle = not sched.running and not sched.waiting
        meta = cast(KVConnectorBase, self.kv_connector).build_connector_meta(None)
        out = self._execute(SchedulerOutput(kv_connector_metadata=meta, kv_wait_s=KV_LOAD_WAIT_S if idle else 0.0))
        sched.update_from_kv_output(out.kv_connector_output)

    def kv_tier_stats(self) -> dict:
        """Each tier's counters (kv_transfer/offloading.py TierStats), by tier; {} without a connector."""
        return self.kv_connector.stats() if self.kv_connector is not None else {}

    def _grammar_backend(self):
        if self.args.structured_outputs_backend == "xgrammar":
            from shoal.workers.structured_output.xgrammar_backend import XgrammarBackend

            return XgrammarBackend(self.tokenizer.backend, self.model_config.vocab_size, self.eos_token_ids)
        from shoal.workers.structured_output.guidance import GuidanceBackend

        return GuidanceBackend(self.tokenizer.backend.to_str(), self.model_config.vocab_size, self.eos_token_ids)

    @property
    def runner(self) -> Runner:
        """Rank 0's runner (tests and benchmarks): a ModelRunner, or a SimulatedRunner for load_format 'simulated'."""
        return self.model_executor.driver_worker.runner

    @property
    def cuda_graphs(self) -> CaptureStats | None:
        """What rank 0 captured at start (benchmarks); None when it runs eagerly."""
        return self.model_executor.driver_worker.cuda_graphs

    # ---- requests -------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send token ids", field="prompt")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(f"prompt must be text or token ids, got {type(prompt).__name__}", field="prompt")
        return list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams, num_resumed_tokens: int = 0) -> None:
        """Refuse, with the field named, what could never be served: the
        rules every front shares (request_checks.check_request), then what
        only this engine knows (its KV cache, its tokenizer).
        num_resumed_tokens: the ids' last ones are output already made (a
        failover); the rest is the prompt."""
        check_request(prompt_ids, params, self.limits, num_resumed_tokens)
        n = len(prompt_ids) - num_resumed_tokens
        need = self.block_manager.blocks_needed(n + params.max_tokens)
        if need > self.block_manager.num_total_blocks:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs {need} KV blocks "
                f"but the whole cache has {self.block_manager.num_total_blocks}",
                field="prompt",
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none", field="stop")
        if params.structured_outputs is not None and self.structured_output is None:
            field = params.structured_outputs.field
            raise InvalidRequestError("structured output needs a tokenizer; this model has none", field=field)

    def check_request(self, request: GenerateRequest, in_flight: Container[str] = ()) -> LoRARequest | None:
        """Every check of a new request, in one place; raises
        InvalidRequestError naming the field, changing nothing. in_flight:
        ids taken beyond this engine's own (AsyncEngine's queued ones).
        Returns the adapter its lora_name names (registered already)."""
        rid = request.request_id
        check_request_id(rid, in_flight)
        check_request_id(rid, self.requests)
        priority = request.priority
        if type(priority) is not int or not -(2**31) <= priority < 2**31:
            raise InvalidRequestError(f"priority must be a 32-bit integer, got {priority!r}", field="priority")
        if not isinstance(request.prompt_token_ids, (list, tuple)):
            raise InvalidRequestError("prompt_token_ids must be a list of token ids", field="prompt")
        self.validate(request.prompt_token_ids, request.params, request.num_resumed_tokens)
        check_cache_salt(request.cache_salt)
        parent = request.parent_request_id
        if parent is not None:
            if not isinstance(parent, str):
                raise InvalidRequestError("parent_request_id must be a string", field="parent_request_id")
            if len(self.scheduler.groups.get(parent, ())) >= self.limits.max_n:
                raise InvalidRequestError(
                    f"parallel-sampling group {parent[:64]!r} already has {self.limits.max_n} samples "
                    "in flight (--max-n)",
                    field="n",
                )
        return None if request.lora_name is None else self.lora_for(request.lora_name)

    def lora_for(self, name: object) -> LoRARequest:
        """The registered adapter called `name` (served by name, or registered by LLM.generate)."""
        if not isinstance(name, str):
            raise InvalidRequestError("lora_name must be a string", field="model")
        found = self.lora_by_name.get(name) or next(
            (r for r in self.lora_requests.values() if r.lora_name == name), None
        )
        if found is None:
            raise InvalidRequestError(f"LoRA adapter {name[:64]!r} is not loaded", field="model")
        return found

    def add_request(self, request: GenerateRequest, grammar=None) -> None:
        """Queue a request, whole (proto.messages.GenerateRequest, its prompt
        tokenized); raises InvalidRequestError (a ValueError) at once for bad
        input, leaving everything else untouched.

        A failover resumes a reply made elsewhere: the prompt's last
        num_resumed_tokens ids are that reply so far, of whose text
        num_resumed_chars characters were sent. They count as output (the
        token budget, min_tokens, penalties, each draw's output index, the
        stop strings' text), so the reply goes on as if never moved.
        block_hashes: the prompt's prefix-cache keys as the router computed
        them (block_hash.chain_hashes), taken when their shape fits, so a
        prompt is hashed once on its way; else the engine hashes it.
        grammar: params.structured_outputs compiled already (AsyncEngine
        compiles off this thread); else it is compiled here (or found in
        the cache). parent_request_id: the request's parallel-sampling group
        (n > 1), whose members share one prefill of the prompt (Scheduler).
        lora_name: the adapter it runs under, registered already
        (register_lora, add_named_lora). cache_salt: salts the prompt's
        prefix-cache keys (block_hash.root_key): it shares blocks only with
        requests of the same salt; the router's block_hashes must be salted
        by it too (they are: the router hashes with it)."""
        lora_request = self.check_request(request)
        if lora_request is not None:
            self.register_lora(lora_request)  # read again (and checked) if evicted from host memory since
        seq = Sequence.from_request(request, next(self._arrivals))
        params, prompt_ids, num_prompt = seq.params, seq.token_ids, seq.num_prompt_tokens
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids[:num_prompt], params.stop, params.skip_special_tokens
            )
            if request.num_resumed_tokens:
                detok.resume(prompt_ids[num_prompt:], request.num_resumed_chars)
        if lora_request is not None:
            seq.lora_request = lora_request
            # Its blocks hold the adapter's keys and values: a prefix cached under another never serves it.
            seq.block_hash_extra = lora_extra(lora_request.lora_int_id)
        elif request.block_hashes:  # the router's keys carry no adapter: a LoRA request's prompt is hashed here
            seq.block_hashes = adopt_chain(request.block_hashes, num_prompt, self.block_manager.block_size)
        if params.structured_outputs is not None:
            sor = self.structured_output.new_request(params.structured_outputs, grammar)
            # A failover's reply so far goes through a new matcher, which then stands where the lost one did.
            if request.num_resumed_tokens and not sor.grammar.accept_tokens(prompt_ids[num_prompt:]):
                raise InvalidRequestError(
                    "the resumed output does not match the structured output's grammar",
                    field=params.structured_outputs.field,
                )
            seq.structured_output_request = sor
        if not params.greedy:
            seq.sampling_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.requests[request.request_id] = _Request(seq, detok)
        self.scheduler.add(seq)
        self.num_prompt_tokens += num_prompt

    def register_lora(self, request: LoRARequest, root: str | None = None) -> None:
        """Check an adapter (its files, against the base model) the first
        time its id is seen, keep its request, and hold the checked tensors
        in host memory: a slot is filled from those alone, never from disk.
        One evicted from there since is read again here (outside any step)
        and refused if its files changed. A different adapter under a known
        id, or any adapter without --enable-lora, is refused. root: a
        runtime load's --lora-root, which its files must lie inside."""
        if not self.args.enable_lora:
            raise InvalidRequestError("LoRA adapters need --enable-lora", field="lora_request")
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError("lora_request must be a LoRARequest", field="lora_request")
        known = self.lora_requests.get(request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise InvalidRequestError(
                    f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} already", field="lora_request"
                )
            if self.lora_host.get(request.lora_int_id) is None:  # evicted from host memory since
                self._hold_lora(request, None, self.lora_host.digest(request.lora_int_id))
            return
        self._hold_lora(request, root)
        self.lora_requests[request.lora_int_id] = request

    def _hold_lora(self, request: LoRARequest, root: str | None, digest: str | None = None) -> None:
        adapter = read_lora_adapter(request, self.model_config, self.args.max_lora_rank, self.model_name, root)
        if digest is not None and adapter.digest != digest:
            logger.warning(
                "LoRA adapter %r: its files at %r changed since it was loaded", request.lora_name, request.lora_path
            )
            raise InvalidRequestError(
                f"LoRA adapter {request.lora_name!r} changed on disk since it was loaded; "
                "load it again under a new name",
                field="lora_request",
            )
        in_use = {r.seq.lora_request.lora_int_id for r in list(self.requests.values()) if r.seq.lora_request}
        self.lora_host.put(adapter, in_use | self.runner.lora_manager.slot_ids())

    def add_named_lora(self, request: LoRARequest, root: str | None = None) -> None:
        """Serve an adapter under its name (--lora-modules, or a runtime load
        whose files must lie inside `root`): checked and registered as
        register_lora does; a name served already is a LoRAAdapterError 'conflict'."""
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError("lora_request must be a LoRARequest", field="lora_request")
        if request.lora_name in self.lora_by_name:
            raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r} is loaded already", "conflict")
        self.register_lora(request, root)
        self.lora_by_name[request.lora_name] = request

    def remove_named_lora(self, name: str, in_flight: int = 0) -> LoRARequest:
        """Stop serving an adapter by name: 'not_found' if none is, 'conflict'
        while a request under it is in the engine, or `in_flight` ones are on
        their way to it (AsyncEngine's), and it stays served. Its slot and host
        copy go by LRU; a reload gets a new id, never these."""
        request = self.lora_by_name.get(name)
        if request is None:
            raise LoRAAdapterError(f"no LoRA adapter named {name!r} is loaded", "not_found")
        n = max(in_flight, self.num_lora_requests(request.lora_int_id))
        if n:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r} is in use by {n} request(s); unload it once they end", "conflict"
            )
        del self.lora_by_name[name]
        self.lora_requests.pop(request.lora_int_id, None)
        self.lora_host.forget(request.lora_int_id)
        return request

    def num_lora_requests(self, lora_int_id: int) -> int:
        """Requests in the engine (waiting or running) under the adapter."""
        reqs = list(self.requests.values())  # one atomic copy: the engine thread may add meanwhile
        return sum(1 for r in reqs if r.seq.lora_request is not None and r.seq.lora_request.lora_int_id == lora_int_id)

    def lora_stats(self) -> tuple[dict[str, tuple[int, int]], tuple[str, ...], tuple[str, ...]]:
        """Where each adapter served by name is (name -> (lora_int_id, LORA_ON_DEVICE /
        LORA_IN_HOST / LORA_ON_DISK)), and the adapters of the running and the
        waiting requests (vLLM's lora_requests_info), by name."""
        if not self.args.enable_lora:
            return {}, (), ()
        table = self.scheduler.lora_table
        device = set(table.slot_of) if table is not None else set()
        manager = getattr(self.runner, "lora_manager", None)
        host = manager.host_ids() if manager is not None else set()
        where = {
            name: (
                r.lora_int_id,
                LORA_ON_DEVICE if r.lora_int_id in device else LORA_IN_HOST if r.lora_int_id in host else LORA_ON_DISK,
            )
            for name, r in list(self.lora_by_name.items())
        }
        running, waiting = set(), set()
        for r in list(self.requests.values()):
            lora = r.seq.lora_request
            if lora is not None:
                (running if r.seq.lora_slot is not None else waiting).add(lora.lora_name)
        return where, tuple(sorted(running)), tuple(sorted(waiting))

    def abort_request(self, request_id: str) -> RequestOutput | PendingOutput | None:
        """Stop a request now; its blocks are free when this returns."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req.seq, "abort")
        self._flush_kv_moves()
        self.num_finished_requests += 1
        return self._delta(req, [], None)

    def has_unfinished_requests(self) -> bool:
        # (ended requests whose blocks a connector still sends: steps poll for the end of that;
        # a step in flight: a step takes its output)
        pipeline = self.pipeline
        return bool(self.requests or self.scheduler.sending or (pipeline is not None and pipeline.inflight))

    # ---- the loop -------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and return a delta for every request
        that produced a token (or finished). A failure that can be pinned
        on one request (its staging, sampling or detokenizing raised) ends
        that request alone, with an error delta, and the rest go on; any
        other failure raises, and the engine is dead."""
        outputs = self._step()
        if self.kv_events is not None:  # the step's changes to the cache and its tiers, in order
            events, self.block_manager.pool.events = self.block_manager.pool.events, []
            if self.kv_connector is not None:
                events += self.kv_connector.take_events()
            self.kv_events.append(events)
        return outputs

    def _execute(self, sched: SchedulerOutput):
        """Every rank's part of a step, waited for: on the compute thread under async scheduling."""
        if self.pipeline is not None:
            return self.pipeline.call(self.model_executor.execute_model, sched)
        return self.model_executor.execute_model(sched)

    def _step(self) -> list[RequestOutput]:
        if self.pipeline is not None and self.pipeline.inflight is not None:
            return self._step_ahead()
        if self.scheduler.loading or self.scheduler.sending:
            self._poll_kv_loads()
        with step_range("schedule"):
            sched = self.scheduler.schedule()
        if sched.is_empty:
            meta = sched.kv_connector_metadata
            if meta is not None and not getattr(meta, "is_empty", True):
                out = self._execute(sched)  # moves gathered with nothing to run
                self.scheduler.update_from_kv_output(out.kv_connector_output)
            return []
        self._grammar_bitmask(sched)
        if self.pipeline is not None and self._launch(sched, None, None):
            return self._step_ahead()
        t0 = time.perf_counter()
        try:
            with step_range("execute_model"):
                out = self._execute(sched)
        except KVLoadError as e:
            self._recompute_unloaded(sched, e)
            return []
        except Exception as e:
            # Nothing advanced: the sequences are as scheduled, and the next
            # step computes the same tokens again (their KV slots rewritten
            # with the same values), less the culprits.
            return [self._fail(seq, err) for seq, err in self._blame(sched, e)]
        self._account(sched, time.perf_counter() - t0)
        self.scheduler.update_from_kv_output(out.kv_connector_output)
        return self._finish_step(sched, out)

    def _grammar_bitmask(self, sched: SchedulerOutput) -> None:
        if self.structured_output is not None:
            with step_range("grammar_bitmask"):
                sched.grammar_bitmask = self.structured_output.grammar_bitmask(sched.seqs_due_token)

    # ---- async scheduling: the next step scheduled while this one computes --------------

    def _launch(self, sched: SchedulerOutput, prep, previous) -> bool:
        """Start computing sched (prepared already, or now) on the compute
        thread, and count it as done (Scheduler.advance_ahead). False,
        changing nothing, where staging it raised: the step then runs one
        at a time, where a request's own failure is pinned on it (_blame)."""
        pipeline = cast(StepPipeline, self.pipeline)
        if prep is None and (prep := self._prepare(sched)) is None:
            return False
        ahead_ok = all(_ahead_safe(seq) for seq in sched.seqs_due_token)  # before advance_ahead moves them
        pipeline.launch(sched, prep, previous, ahead_ok)
        self.scheduler.advance_ahead(sched)
        return True

    def _prepare(self, sched: SchedulerOutput):
        """The step staged for the compute thread; None where staging raised."""
        try:
            return cast(StepPipeline, self.pipeline).runner.prepare(sched)
        except Exception as e:
            logger.debug("staging a step ahead failed (%s: %s): it runs one at a time", type(e).__name__, e)
            return None

    def _step_ahead(self) -> list[RequestOutput]:
        """A step is computing: schedule and stage the next one meanwhile,
        unless some sequence of it needs its token first (a grammar, a
        penalty counting its tokens); then take its output, launch the next,
        and make the deltas while that one computes."""
        pipeline = cast(StepPipeline, self.pipeline)
        cur = cast(InFlight, pipeline.inflight)
        nxt = prep = None
        if cur.ahead_ok:
            with step_range("schedule"):
                nxt = self.scheduler.schedule()
            if not nxt.is_empty:
                self._grammar_bitmask(nxt)  # its constrained rows are new ones: no placeholder is theirs
                prep = self._prepare(nxt)
            if prep is None:  # nothing to run, or staging raised: the next schedule has it again
                nxt = None
        try:
            out, dt = pipeline.wait()
        except Exception as e:
            # Nothing is counted done: the sequences are as scheduled (the next schedule
            # computes the same tokens again), less the culprits. The next step, staged or
            # not, is dropped; what it allocated is counted from the sequences again.
            self.scheduler.undo_ahead(cur.sched)
            running = [(s, n) for s, n in cur.sched.scheduled if s.status is SequenceStatus.RUNNING]
            return [self._fail(seq, err) for seq, err in self._blame(SchedulerOutput(running), e)]
        self._account(cur.sched, dt)
        if nxt is not None:
            self._launch(nxt, prep, out)
        return self._finish_step(cur.sched, out, ahead=True)

    def _account(self, sched: SchedulerOutput, dt: float) -> None:
        self.num_steps += 1
        self.step_seconds += dt
        if (n := sched.num_batched_tokens) >= PREFILL_SAMPLE_TOKENS:
            us = 1e6 * dt / n
            last = self.prefill_us_per_token
            self.prefill_us_per_token = us if not last else last + PREFILL_EWMA * (us - last)

    def _finish_step(self, sched: SchedulerOutput, out, ahead: bool = False) -> list[RequestOutput]:
        """The step's tokens into its sequences, and a delta for each (ahead:
        it was counted by advance_ahead; a request that ended since has no delta)."""
        tokens = out.sampled_token_ids
        live = [seq.status is not SequenceStatus.FINISHED for seq in out.seqs]
        stop_strings, failed = [], {}
        with step_range("detokenize"):
            for seq, token, ok in zip(out.seqs, tokens, live):
                if not ok or (self.defer_outputs and self._deferred(self.requests[seq.request_id])):
                    stop_strings.append(None)  # no stop string to find; its text is made later
                    continue
                try:
                    stop_strings.append(self._detokenize(seq, token))
                except Exception as e:  # this request's text alone
                    stop_strings.append(None)
                    failed[seq.request_id] = e
        with step_range("update_from_output"):
            finished = self.scheduler.update_from_output(sched, out, stop_strings, ahead)
        deltas = []
        with step_range("detokenize"):  # the outputs: one delta per token
            for seq, token, lp, ok in zip(out.seqs, tokens, out.logprobs, live):
                if not ok:
                    continue
                if seq.request_id in failed:
                    deltas.append(self._fail(seq, failed[seq.request_id]))
                    continue
                logprobs = None if lp is None else [TokenLogprob(token, *lp)]
                deltas.append(self._delta(self.requests[seq.request_id], [token], logprobs))
        for seq in finished:
            if seq.request_id not in failed:
                del self.requests[seq.request_id]
        self.num_generation_tokens += sum(live)
        self.num_finished_requests += len(finished) - sum(1 for s in finished if s.request_id in failed)
        if finished:
            self._flush_kv_moves()
        return deltas

    def _recompute_unloaded(self, sched: SchedulerOutput, error: KVLoadError) -> None:
        """A step whose connector could not load some blocks ran no forward.
        Each sequence holding one goes back to its first such block: the blocks
        from there leave the prefix index (and the tier forgets them), and the
        next step computes them, so its tokens are as if no tier had them."""
        logger.warning("%s; computing them instead", error)
        bs, pool = self.block_manager.block_size, self.block_manager.pool
        for seq, _ in sched.scheduled:
            bad = next((i for i, b in enumerate(seq.block_table) if b in error.block_ids), None)
            if bad is None:
                continue
            for i in range(bad, seq.num_registered_blocks):
                block = pool.blocks[seq.block_table[i]]
                if block.block_hash is not None and self.kv_connector is not None:
                    self.kv_connector.discard(block.block_hash)
                pool.uncache_block(seq.block_table[i])
            seq.num_registered_blocks = min(seq.num_registered_blocks, bad)
            seq.num_computed_tokens = min(seq.num_computed_tokens, bad * bs)
            seq.num_cached_tokens = min(seq.num_cached_tokens, seq.num_computed_tokens)

    def _blame(self, sched: SchedulerOutput, error: Exception) -> list[tuple[Sequence, Exception]]:
        """The requests a failed step's error belongs to, found by running
        halves of the batch again (log2 of its size in extra runs per
        culprit; the runner changes no sequence, so a probe is harmless).
        Raises `error` when it is not one request's: a fault of the engine
        or device, a tensor-parallel step (its ranks run every batch in
        lockstep), or a batch that fails only as a whole."""
        if self.args.tensor_parallel_size > 1 or is_engine_fault(error, self.device):
            raise error
        culprits: list[tuple[Sequence, Exception]] = []

        def probe(group: list) -> Exception | None:
            # With the group's LoRA slots: a slot fill that fails is then pinned on its adapter's requests.
            slots = {s.lora_slot: s.lora_request for s, _ in group if s.lora_slot is not None}
            try:
                self._execute(SchedulerOutput(group, lora_slots=slots))
            except Exception as e:
                if is_engine_fault(e, self.device):
                    raise
                return e
            return None

        def search(group: list, err: Exception) -> None:
            if len(group) == 1:
                culprits.append((group[0][0], err))
                return
            mid = len(group) // 2
            for half in (group[:mid], group[mid:]):
                if (e := probe(half)) is not None:
                    search(half, e)

        search(list(sched.scheduled), error)
        if not culprits:
            raise error
        return culprits

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End one request with an error delta; its blocks are free at once."""
        logger.warning("request %s failed alone: %s: %s", seq.request_id, type(error).__name__, error)
        self.requests.pop(seq.request_id, None)
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq, "error")
        seq.finish_reason, seq.stop_reason = "error", None
        self.num_finished_requests += 1
        message = f"request {seq.request_id} failed in the engine: {type(error).__name__}: {error}"
        # No text: the request's detokenizer may be what failed.
        return RequestOutput(
            seq.request_id,
            [],
            "",
            "error",
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
            seq.num_sampled_tokens,
            seq.timings,
            error=message,
        )

    def _detokenize(self, seq: Sequence, token: int) -> str | None:
        """Adds the sampled token to the request's text; returns the stop
        string the text now holds, if the token may stop it (min_tokens
        counts the token itself, not yet appended)."""
        detok = self.requests[seq.request_id].detok
        if detok is None:
            return None
        return detok.add(token, seq.num_sampled_tokens + 1 >= seq.params.min_tokens)

    @staticmethod
    def _deferred(req: _Request) -> bool:
        """Whether the request's text may be made after its step (it has no stop strings)."""
        return req.detok is not None and not req.detok.stop

    def _delta(self, req: _Request, tokens: list[int], lp) -> RequestOutput | PendingOutput:
        seq = req.seq
        finished = seq.finish_reason is not None
        deferred = self.defer_outputs and self._deferred(req)
        text = req.detok.take(finished) if req.detok is not None and not deferred else ""
        out = RequestOutput(
            seq.request_id,
            tokens,
            text,
            seq.finish_reason,
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
            seq.num_sampled_tokens,
            seq.timings,
            lp,
            stop_reason=seq.stop_reason,
        )
        return PendingOutput(out, req.detok, tokens[0] if tokens else None) if deferred else out

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            self.scheduler.num_running,
            self.scheduler.num_waiting,
            bm.num_free_blocks,
            bm.num_total_blocks,
            bm.prefix_cache_hit_rate,
            self.scheduler.num_preemptions,
            self.scheduler.num_waiting_tokens,
            bm.pool.num_query_tokens,
            bm.pool.num_hit_tokens,
            self.num_prompt_tokens,
            self.num_generation_tokens,
            self.num_finished_requests,
        )

    def check_health(self) -> None:
        """Raise if a tensor-parallel rank is gone."""
        self.model_executor.check_health()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do at size 1)."""
        if getattr(self, "pipeline", None) is not None:
            self.pipeline.shutdown()
        if getattr(self, "structured_output", None) is not None:
            self.structured_output.shutdown()
        if getattr(self, "kv_connector", None) is not None:
            try:
                self._flush_kv_moves()  # an abort's writes, if it was the last thing to happen
            finally:
                self.kv_connector.shutdown()
        if getattr(self, "model_executor", None) is not None:
            runner_connector = getattr(self.model_executor.driver_worker.runner, "kv_connector", None)
            if runner_connector is not None:
                runner_connector.shutdown()
            self.model_executor.shutdown()


def _check_kv_connector_args(args: EngineArgs) -> None:
    """The KV tiers' settings, before anything loads."""
    if type(args.kv_offload_host_bytes) is not int or args.kv_offload_host_bytes < 0:
        raise ValueError(f"kv_offload_host_bytes must be an integer >= 0; got {args.kv_offload_host_bytes!r}")
    if args.load_format == "simulated":
        raise ValueError("load_format 'simulated' has no KV cache: a KV connector needs a real model")
    # Every tier runs under tensor parallelism, its ranks agreeing on their loads (kv_transfer/offloading.py).
    if args.tensor_parallel_size > 1 and args.kv_connector not in (None, "offloading"):
        raise ValueError(f"kv_connector {args.kv_connector!r} runs on one rank for now; 'offloading' on any")
    if type(args.kv_offload_disk_bytes) is not int or args.kv_offload_disk_bytes < 0:
        raise ValueError(f"kv_offload_disk_bytes must be an integer >= 0; got {args.kv_offload_disk_bytes!r}")
    if args.kv_offload_disk_path is not None and not os.path.isabs(args.kv_offload_disk_path):
        raise ValueError(f"kv_offload_disk_path must be an absolute path; got {args.kv_offload_disk_path!r}")
    if args.kv_cluster_tier not in (None, "object-store"):
        raise ValueError(f"kv_cluster_tier must be 'object-store' or unset; got {args.kv_cluster_tier!r}")
    if type(args.kv_cluster_bytes) is not int or args.kv_cluster_bytes < 1:
        raise ValueError(f"kv_cluster_bytes must be an integer >= 1; got {args.kv_cluster_bytes!r}")
    name = cast(str, connector_name(args))
    connector_class(name)  # importable, and a connector
    if name == "offloading" and not (args.kv_offload_host_bytes or args.kv_offload_disk_path or args.kv_cluster_tier):
        raise ValueError(
            "kv_connector 'offloading' needs a tier: set kv_offload_host_bytes, kv_offload_disk_path or kv_cluster_tier"
        )


def _check_lora_args(args: EngineArgs) -> None:
    """--enable-lora's settings, before anything loads."""
    if args.load_format == "simulated":
        raise ValueError("load_format 'simulated' has no layers to adapt: LoRA needs a real model")
    for name in ("max_loras", "max_lora_rank"):
        value = getattr(args, name)
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
    if args.max_cpu_loras is not None and (type(args.max_cpu_loras) is not int or args.max_cpu_loras < args.max_loras):
        raise ValueError(
            f"max_cpu_loras must be an integer >= max_loras ({args.max_loras}); got {args.max_cpu_loras!r}"
        )
    if type(args.max_runtime_loras) is not int or args.max_runtime_loras < 0:
        raise ValueError(f"max_runtime_loras must be an integer >= 0; got {args.max_runtime_loras!r}")
    if args.lora_root is not None and not os.path.isabs(args.lora_root):
        raise ValueError(f"lora_root must be an absolute path; got {args.lora_root!r}")

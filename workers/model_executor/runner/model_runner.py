"""Owns the model and its KV cache; turns a scheduled batch into one flat
forward pass and samples the next tokens. It only computes: the scheduler
applies what a step did to the sequences.

Under tensor parallelism every rank runs one of these over its own slice
of the model and cache; only rank 0 gets logits and samples.

The attention backend is picked once, at construction (layers/attention/
selector.py); each step the runner stages the batch, asks the backend's
builder for the step's metadata and runs the model, or for a decode-only
step replays a CUDA graph (cuda_graph.py) or takes the one-call CPU decode
step (platforms/cpu/decode_step.py).
"""

from __future__ import annotations

import bisect
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from shoal.proto.sampling_params import SamplingParams
from shoal.proto.utils import cdiv
from shoal.workers.core.outputs import ModelRunnerOutput
from shoal.workers.core.scheduler import SchedulerOutput
from shoal.workers.core.sequence import PLACEHOLDER_TOKEN_ID, RequestTimings, Sequence
from shoal.workers.fault_injection import FaultPlan
from shoal.workers.kv_transfer.base import KVConnectorBase, KVLoadError
from shoal.workers.lora.layers import lora_context
from shoal.workers.lora.manager import LoRAModelManager
from shoal.workers.lora.ops import NO_LORA
from shoal.workers.model_executor.layers.attention import set_forward_context
from shoal.workers.model_executor.layers.attention.backends.abstract import CommonAttentionMetadata
from shoal.workers.model_executor.layers.attention.kv_cache import kv_cache_torch_dtype
from shoal.workers.model_executor.layers.attention.selector import get_attn_backend
from shoal.workers.model_executor.layers.parallel_state import num_local_kv_heads
from shoal.workers.model_executor.memory.cpu_memory import release_free_heap
from shoal.workers.model_executor.models.llama import LlamaForCausalLM
from shoal.workers.model_executor.platforms.interface import DecodeStep
from shoal.workers.model_executor.runner.cuda_graph import CaptureStats, DecodeGraphs, capture_sizes
from shoal.workers.model_executor.runner.input_batch import InputBatch
from shoal.workers.model_executor.runner.staging_buffer import StagedBatch, StagingBuffer
from shoal.workers.model_executor.sampling.builder import stage_sampling_metadata
from shoal.workers.model_executor.sampling.metadata import SamplingMetadata
from shoal.workers.model_executor.sampling.sampler import Sampler
from shoal.workers.profiling import step_range

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30

_PAD_INPUT = 0  # a padding row's token id and position


def _lora_slot(seq) -> int:
    slot = getattr(seq, "lora_slot", None)
    return NO_LORA if slot is None else slot


def _longest_first(row: tuple) -> int:
    return -row[0].num_computed_tokens


def _lora_order(row: tuple) -> int:
    """Decodes, then prompt chunks (the graphs want decodes first), each grouped by adapter slot (a stable sort)."""
    return (row[1] != 1) * (1 << 20) + _lora_slot(row[0])


@dataclass(slots=True)
class _FlatBatch:
    """One step's rows (sequence, new tokens) in the flat batch's order, a
    list entry a row, and its flat inputs, an array entry a token."""

    seqs: list
    num_new: list[int]  # new tokens a row
    seq_lens: list[int]  # its context after the step
    lens: list[int]  # len(token_ids)
    table_rows: np.ndarray  # its row of the runner's InputBatch
    num_decodes: int  # rows [0, num_decodes) bring one token each
    input_ids: np.ndarray  # int64 [tokens]
    positions: np.ndarray
    slots: np.ndarray
    logits_indices: np.ndarray  # [rows due a token]
    due_mask: list[bool]  # the step computes its last token
    has_placeholders: bool  # some input is PLACEHOLDER_TOKEN_ID

    def max_blocks(self, block_size: int) -> int:
        return cdiv(max(self.seq_lens, default=0), block_size)


@dataclass(slots=True)
class PreparedStep:
    """A step staged from its sequences (ModelRunner.prepare), to compute
    and sample (run_prepared), perhaps on another thread."""

    sched: SchedulerOutput
    due: list = field(default_factory=list)  # the sequences due a token, in the rows' order
    tensors: dict = field(default_factory=dict)  # the staged inputs, uploaded
    batch: StagedBatch | None = None
    attn_metadata: Any = None  # the backend's; None where a CUDA graph replays
    sampling: SamplingMetadata | None = None  # of the due rows
    graph_size: int | None = None
    hooks: object | None = None  # a KV connector's per-layer hooks
    placeholder_rows: list[int] = field(default_factory=list)  # flat inputs the step before's tokens fill
    placeholder_seqs: list = field(default_factory=list)  # ...and whose tokens they are


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        block_size: int,
        eos_token_ids: list[int],
        attention_backend: str,
        max_model_len: int,
        max_num_seqs: int = 256,
        enforce_eager: bool = False,
        cpu_kernels: bool = True,
        kv_cache_dtype: str = "auto",
    ):
        """Call initialize_kv_cache before the first step; cpu_kernels and
        kv_cache_dtype as EngineArgs has them."""
        self.model = model
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids  # banned before min_tokens
        self.device, self.dtype = next(model.parameters()).device, model.dtype
        self.kv_cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, self.dtype)
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        self.max_num_seqs = max_num_seqs
        self.enforce_eager = enforce_eager
        self.kv_cache: torch.Tensor | None = None
        self.pad_block: int | None = None  # the spare block CUDA-graph padding rows write to
        self.graphs: DecodeGraphs | None = None
        self.staging = StagingBuffer(self.device)
        self.input_batch = InputBatch(self.max_blocks_per_seq, max_num_seqs)
        self.sampler = Sampler()
        self.fault_plan = FaultPlan.from_env()  # None unless a test asks for faults
        self.attn_backend = get_attn_backend(
            attention_backend, self.device, self.dtype, block_size, cpu_kernels, self.kv_cache_dtype
        )
        self.attn_metadata_builder = self.attn_backend.builder_cls(block_size, self.device)
        # The compiled kernels reach the other layers here, once (platforms/cpu/bind.py), and with
        # them the one-call decode step where it applies. The CPU platform is imported only where
        # its kernels run: it needs the gguf package, which a GPU machine may lack.
        self.cpu_decode_step: DecodeStep | None = None
        if self.attn_backend.uses_cpu_kernels:
            from shoal.workers.model_executor.platforms.cpu.bind import bind as bind_cpu_kernels
            from shoal.workers.model_executor.platforms.cpu.decode_step import CPUDecodeStep
            from shoal.workers.model_executor.platforms.cpu.kernels import load as load_cpu_kernels

            bound = bind_cpu_kernels(model, load_cpu_kernels())
            self.sampler.cpu_kernels = bound
            self.cpu_decode_step = CPUDecodeStep.create(model, bound)
        self.lora_manager: LoRAModelManager | None = None
        # The KV connector's worker side (kv_transfer/), set by the rank worker with the cache.
        self.kv_connector: KVConnectorBase | None = None

    def enable_lora(
        self, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None, lora_dtype: torch.dtype | None = None
    ) -> None:
        """LoRA slots beside the model's projections (workers/lora/), kept in
        lora_dtype (default: the model's). Every step then runs the layers'
        own forward, which adds each row's adapter (no one-call CPU decode
        step); each token's slot is staged with the step's inputs, so a
        decode step's CUDA graph reads it from its static buffer and filling
        a slot (a copy into fixed tensors) never calls for a new capture."""
        self.lora_manager = LoRAModelManager(
            self.model, max_loras, max_lora_rank, max_cpu_loras, lora_dtype or self.dtype, self.device
        )
        self.cpu_decode_step = None

    @property
    def varlen(self) -> bool:
        """Whether the step's attention is one varlen kernel call per layer."""
        return self.attn_backend.varlen

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates the cache (freeing any earlier one) and binds each
        layer to its slice and to a fresh impl of the attention backend (the
        torch path's gather buffers go with the old cache). A varlen backend
        gets one spare block past num_blocks for CUDA-graph padding rows."""
        self.kv_cache = None
        if self.cpu_decode_step is not None:
            self.cpu_decode_step.unbind()
        cfg = self.model.config
        kv_heads = self.model.attention_layers()[0].num_kv_heads  # this rank's
        self.pad_block = num_blocks if self.varlen else None
        total = num_blocks + (1 if self.varlen else 0)
        shape = (2, cfg.num_hidden_layers, total, self.block_size, kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        impl = self.attn_backend.impl_cls()  # one for all layers
        names = {id(m): name for name, m in self.model.named_modules()}
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            attn.impl = impl
            attn.layer_name = names.get(id(attn), f"layers.{i}")
        if self.device.type == "cpu":
            # The heap now holds weights and cache; what loading left free goes back (memory/cpu_memory.py).
            release_free_heap()

    def release_kv_cache(self) -> None:
        self.kv_cache = None
        if self.cpu_decode_step is not None:
            self.cpu_decode_step.unbind()
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)

    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
        """One block's keys and values on one rank; dtype: the cache's (one byte for fp8)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        kv_heads = num_local_kv_heads(cfg.num_key_value_heads, tp_size)
        return 2 * cfg.num_hidden_layers * block_size * kv_heads * cfg.head_dim * itemsize

    @staticmethod
    def kv_budget_bytes(args, device: torch.device) -> int:
        """This rank's KV budget where no profiling forward sizes it: as
        asked, else what the GPU memory utilization cap leaves beside what
        is in use now (weights loaded), or a fixed amount of RAM."""
        if args.kv_cache_memory_bytes is not None:
            return args.kv_cache_memory_bytes
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return int(total * args.gpu_memory_utilization) - (total - free)
        return DEFAULT_CPU_KV_BYTES

    # ---- memory profiling ----------------------------------------------

    def _profile_lengths(self, num_tokens: int) -> list[int]:
        cap = self.max_blocks_per_seq * self.block_size
        return [min(cap, num_tokens - start) for start in range(0, num_tokens, cap)]

    def profile_num_blocks(self, num_tokens: int) -> int:
        """The KV blocks profile_run writes."""
        return sum(cdiv(n, self.block_size) for n in self._profile_lengths(num_tokens))

    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """The largest activations a step can need: a prefill of num_tokens
        (in prompts no longer than max_model_len), then the sampler over
        num_seqs rows with top-k and top-p (a sort of the whole vocabulary).
        Needs a KV cache of at least profile_num_blocks(num_tokens) blocks."""
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)
        scheduled, next_block = [], 0
        for i, n in enumerate(self._profile_lengths(num_tokens)):
            seq = Sequence(f"profile-{i}", [0] * n, n, params, i, 0, RequestTimings(0.0))
            num_blocks = cdiv(n, self.block_size)
            seq.block_table = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            scheduled.append((seq, n))
        self._run(scheduled, sample=False)
        seqs = [Sequence(f"profile-s{i}", [0], 1, params, i, 0, RequestTimings(0.0)) for i in range(num_seqs)]
        logits = torch.zeros(num_seqs, self.model.config.vocab_size, dtype=torch.float32, device=self.device)
        batch = self.staging.begin()
        pending = stage_sampling_metadata(seqs, self.eos_token_ids, self.model.config.vocab_size, batch)
        self.sampler(logits, pending.resolve(batch.upload(), self.device))

    # ---- CUDA graphs ---------------------------------------------------

    def capture_cudagraphs(self) -> CaptureStats:
        """Capture decode steps at every bucket size (replayed eagerly off
        CUDA, where only the padding and the static buffer are exercised)."""
        assert self.varlen and self.kv_cache is not None, "graphs need a varlen backend and the KV cache"
        self.graphs = DecodeGraphs(capture_sizes(self.max_num_seqs), self.device)
        with torch.inference_mode():
            stats = self.graphs.capture(
                lambda size: self._stage_varlen(self._flat_batch([]), size, self.staging.begin()), self._forward_decode
            )
        logger.info("%s", stats.describe())
        return stats

    def _forward_decode(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """A decode step of the graphs' layout: its rows are known by the staged tensors alone."""
        meta = self.attn_metadata_builder.build(self._common_metadata(t, 1))
        with set_forward_context(meta), lora_context(t.get("lora_slots")):
            return self.model(t["input_ids"], t["positions"], t["logits_indices"])

    # ---- one step ------------------------------------------------------

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step: the sequences due a token and what was sampled for
        them, in order."""
        return self.run_prepared(self.prepare(sched))

    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """Stage the step's inputs from its sequences as they are now: the
        engine may change them (schedule the next step) while run_prepared
        computes this one on another thread (async scheduling)."""
        if not sched.scheduled:  # the connector's moves alone (LLMEngine._flush_kv_moves)
            return PreparedStep(sched)
        return self._prepare(sched.scheduled, sample=True, grammar_bitmask=sched.grammar_bitmask, sched=sched)

    def run_prepared(self, prep: PreparedStep, previous: ModelRunnerOutput | None = None) -> ModelRunnerOutput:
        """Compute a prepared step and sample its tokens. previous: the step
        before's output, whose tokens stand where this step's inputs hold
        placeholders (it was prepared while that one computed)."""
        sched = prep.sched
        if self.lora_manager is not None:
            with step_range("lora_slots"):
                self.lora_manager.set_active(sched.lora_slots)
        self._move_kv(sched.kv_connector_metadata)
        kv_output = self.kv_connector.get_finished(sched.kv_wait_s) if self.kv_connector is not None else None
        if not sched.scheduled:
            return ModelRunnerOutput([], [], [], kv_output)
        if prep.placeholder_seqs:
            self._fill_placeholders(prep, previous)
        logits = self._forward(prep)
        seqs = prep.due
        if self.kv_connector is not None:  # the forward wrote the step's blocks, prefill chunks' too
            self.kv_connector.wait_for_save()
        if not seqs:
            return ModelRunnerOutput([], [], [], kv_output)
        if self.fault_plan is not None:  # tests only (workers/fault_injection.py)
            self.fault_plan.before_sampling(seqs)
        with step_range("sample"):
            out = self.sampler(logits, cast(SamplingMetadata, prep.sampling))  # set where a row is due
        return ModelRunnerOutput(seqs, out.sampled_token_ids, out.logprobs, kv_output)

    @staticmethod
    @torch.inference_mode()
    def _fill_placeholders(prep: PreparedStep, previous: ModelRunnerOutput | None) -> None:
        if previous is None:
            raise RuntimeError("a step prepared with placeholders ran without the step before's tokens")
        sampled = {id(seq): token for seq, token in zip(previous.seqs, previous.sampled_token_ids)}
        tokens = [sampled[id(seq)] for seq in prep.placeholder_seqs]
        ids = prep.tensors["input_ids"]
        ids[torch.as_tensor(prep.placeholder_rows, device=ids.device)] = torch.tensor(tokens, dtype=ids.dtype).to(
            ids.device, non_blocking=True
        )

    def _move_kv(self, metadata) -> None:
        """The connector's moves for the step, before its forward writes or reads any block."""
        if self.kv_connector is not None and metadata is not None:
            with step_range("kv_connector"):
                self.kv_connector.start_load_kv(metadata)

    def execute_model(
        self,
        scheduled: list,
        lora_slots: dict | None = None,
        lora_adapters: dict | None = None,
        kv_connector_metadata: object | None = None,
        kv_wait_s: float = 0.0,
    ) -> tuple[list, torch.Tensor | None]:
        """The forward pass alone (tensor-parallel ranks other than 0): the
        sequences due a token and their logits (None on those ranks).
        lora_slots: the adapters the step's slots must hold (rank 0's SchedulerOutput.lora_slots);
        lora_adapters: the held adapters of the slots the step changes, sent by rank 0;
        kv_connector_metadata: the KV connector's moves, made on this rank's slice before the forward;
        kv_wait_s: how long its loads in flight may be waited for (rank 0's SchedulerOutput.kv_wait_s)."""
        if self.lora_manager is not None and lora_slots:
            self.lora_manager.set_active(lora_slots, lora_adapters)
        try:
            self._move_kv(kv_connector_metadata)
        except KVLoadError:  # every rank agreed on it (the connector's collective): rank 0 skips the forward too
            return [], None
        if self.kv_connector is not None:
            # Writes what landed on every rank, agreed with rank 0's call; rank 0 reports the step's loads.
            self.kv_connector.get_finished(kv_wait_s)
        if not scheduled:  # the connector's moves alone
            return [], None
        seqs, logits, _ = self._run(scheduled, sample=False)
        if self.kv_connector is not None:  # this rank's slice of the step's blocks, written by its forward
            self.kv_connector.wait_for_save()
        return seqs, logits

    def _run(self, scheduled: list, sample: bool, grammar_bitmask=None):
        """scheduled: (sequence, new tokens) pairs; a sequence is anything
        with token_ids, num_computed_tokens and block_table (a rank's
        mirror will do when sample is False). grammar_bitmask: the
        constrained rows' token masks (SchedulerOutput.grammar_bitmask)."""
        prep = self._prepare(scheduled, sample, grammar_bitmask)
        return prep.due, self._forward(prep), prep.sampling

    @torch.inference_mode()
    def _prepare(self, scheduled: list, sample: bool, grammar_bitmask=None, sched=None) -> PreparedStep:
        step = self._flat_batch(scheduled)
        seqs, num_decodes = step.seqs, step.num_decodes
        due = [s for s, d in zip(seqs, step.due_mask) if d]
        graph_size = None
        # Any step of one-token rows fits a graph: a one-token prompt chunk not
        # due a token only leaves its logits row unread (logits_indices pads on).
        hooks = self.kv_connector if self.kv_connector is not None and self.kv_connector.uses_layer_hooks else None
        if self.graphs is not None and num_decodes == len(seqs) and hooks is None:
            graph_size = self.graphs.padded_size(len(seqs))

        with step_range("prepare_inputs"):
            batch = self.staging.begin()
            if self.varlen:
                self._stage_varlen(step, graph_size, batch)
            else:
                self._stage_flat(step, batch)
            pending = None
            if sample and due:
                pending = stage_sampling_metadata(
                    due, self.eos_token_ids, self.model.config.vocab_size, batch, grammar_bitmask
                )
            t = batch.upload()  # the step's one host-to-device copy
            metadata = pending.resolve(t, self.device) if pending is not None else None
            meta = None
            if graph_size is None:
                common = self._common_metadata(
                    t,
                    max(step.num_new, default=0),
                    num_decodes=num_decodes,
                    query_lens=step.num_new,
                    seq_lens_cpu=step.seq_lens,
                    block_tables_cpu=[s.block_table for s in seqs],
                    # (a varlen backend reads the staged block_tables instead)
                    block_tables_np=None
                    if self.varlen
                    else self.input_batch.gather(step.table_rows, step.max_blocks(self.block_size)),
                )
                meta = self.attn_metadata_builder.build(common)
            placeholder_rows, placeholder_seqs = self._placeholders(step)
        return PreparedStep(sched, due, t, batch, meta, metadata, graph_size, hooks, placeholder_rows, placeholder_seqs)

    def _flat_batch(self, scheduled: list) -> _FlatBatch:
        """The step's rows in the flat batch's order and its flat inputs.
        Decodes first, longest context first, so the torch backend can batch
        them in a few groups of similar length; with adapters, rows of one
        adapter together (one segment each, not one a row). A row's numbers
        are gathered in Python (cheaper than numpy's calls at a few rows);
        everything a token or a block is array work."""
        decodes = [r for r in scheduled if r[1] == 1]
        decodes.sort(key=_longest_first)
        rows = decodes if len(decodes) == len(scheduled) else decodes + [r for r in scheduled if r[1] != 1]
        if self.lora_manager is not None:
            rows.sort(key=_lora_order)
        seqs = [s for s, _ in rows]
        num_new = [n for _, n in rows]
        computed = [s.num_computed_tokens for s in seqs]
        lens = [len(s.token_ids) for s in seqs]
        seq_lens = [c + n for c, n in zip(computed, num_new)]
        due_mask = [a == b for a, b in zip(seq_lens, lens)]  # SchedulerOutput.due_token
        table_rows = self.input_batch.rows_for([s.block_table for s in seqs])
        num_decodes, k = len(decodes), len(rows)
        if num_decodes == k:  # one token a row: no repeats, ranges or slices
            ids = [s.token_ids[p] for s, p in zip(seqs, computed)]
            input_ids = np.array(ids, dtype=np.int64)
            positions = np.array(computed, dtype=np.int64)
            token_rows = table_rows
            logits_rows = np.arange(k) if all(due_mask) else np.flatnonzero(due_mask)
        else:
            ids = [s.token_ids[p] for s, p in zip(seqs[:num_decodes], computed)]
            for s, p, n in zip(seqs[num_decodes:], computed[num_decodes:], num_new[num_decodes:]):
                ids += s.token_ids[p : p + n]
            input_ids = np.array(ids, dtype=np.int64)
            new = np.array(num_new, dtype=np.int64)
            ends = np.cumsum(new)
            positions = np.arange(ends[-1], dtype=np.int64) + np.repeat(np.array(computed) - (ends - new), new)
            token_rows = np.repeat(table_rows, new)
            logits_rows = (ends - 1)[np.array(due_mask)]
        return _FlatBatch(
            seqs=seqs,
            num_new=num_new,
            seq_lens=seq_lens,
            lens=lens,
            table_rows=table_rows,
            num_decodes=num_decodes,
            input_ids=input_ids,
            positions=positions,
            slots=self.input_batch.slots(token_rows, positions, self.block_size),
            logits_indices=logits_rows,
            due_mask=due_mask,
            has_placeholders=PLACEHOLDER_TOKEN_ID in ids,  # a scan in C: async scheduling's steps only
        )

    @staticmethod
    def _placeholders(step: _FlatBatch) -> tuple[list[int], list]:
        """The flat inputs that are a token of the step in flight (async
        scheduling: filled at run time from its output), and their sequences.
        Only a sequence's last token can be one, read by a decode."""
        if not step.has_placeholders:
            return [], []
        flat = np.flatnonzero(step.input_ids == PLACEHOLDER_TOKEN_ID).tolist()
        ends = list(itertools.accumulate(step.num_new))
        seqs = []
        for j in flat:
            i = bisect.bisect_right(ends, j)
            seq = step.seqs[i]
            if (
                step.num_new[i] != 1
                or step.lens[i] != step.seq_lens[i]
                or getattr(seq, "num_output_placeholders", 0) != 1
            ):
                raise RuntimeError(f"request {seq.request_id}: a step may read one placeholder, its last token")
            seqs.append(seq)
        return flat, seqs

    @torch.inference_mode()
    def _forward(self, prep: PreparedStep) -> torch.Tensor:
        t, meta = prep.tensors, prep.attn_metadata
        with step_range("forward"):
            if prep.graph_size is not None:
                graphs = cast(DecodeGraphs, self.graphs)  # graph_size is set only with graphs
                return graphs.replay(prep.graph_size, cast(StagedBatch, prep.batch), self._forward_decode)[
                    : len(prep.due)
                ]
            if self.cpu_decode_step is not None and meta.decode_only and prep.hooks is None:
                return self.cpu_decode_step.forward(t["input_ids"], t["positions"], t["logits_indices"], meta)
            # (a connector's per-layer hooks run in the layers' Python: no graph, no fused step)
            with set_forward_context(meta, prep.hooks), lora_context(t.get("lora_slots")):
                return self.model(t["input_ids"], t["positions"], t["logits_indices"])

    @staticmethod
    def _lora_token_slots(step: _FlatBatch) -> np.ndarray:
        """Each token's adapter slot (NO_LORA: the base model), in the flat batch's order."""
        return np.repeat(np.array([_lora_slot(s) for s in step.seqs], dtype=np.int64), step.num_new)

    @staticmethod
    def _common_metadata(t: dict[str, torch.Tensor], max_query_len: int, **rows) -> CommonAttentionMetadata:
        """The step for the backend's builder: the staged tensors (the varlen
        ones, where staged) and `rows`, the host lists (none for a graph's capture)."""
        return CommonAttentionMetadata(
            slot_mapping=t["slot_mapping"],
            max_query_len=max_query_len,
            block_table_tensor=t.get("block_tables"),
            seq_lens=t.get("seq_lens"),
            query_start_loc=t.get("query_start_loc"),
            **rows,
        )

    def _stage_flat(self, step: _FlatBatch, batch: StagedBatch) -> None:
        self._stage_flat_lists(batch, step.input_ids, step.positions, step.slots, step.logits_indices)
        if self.lora_manager is not None:
            batch.add("lora_slots", self._lora_token_slots(step), torch.int32)

    def _stage_varlen(self, step: _FlatBatch, pad_to: int | None, batch: StagedBatch) -> StagedBatch:
        """The flat inputs plus block tables, sequence lengths and query
        offsets. pad_to: a CUDA graph's batch size; rows past the real ones
        are one-token sequences in the spare block, and every block table is
        as wide as max_model_len needs, so the layout is the graph's."""
        input_ids, positions, slots, logits_indices = step.input_ids, step.positions, step.slots, step.logits_indices
        seq_lens, query_lens = step.seq_lens, step.num_new
        pad_value = self.pad_block if self.pad_block is not None else 0
        rows = len(step.seqs)
        if pad_to is None:
            width = step.max_blocks(self.block_size)
            pad = 0
        else:
            width, pad = self.max_blocks_per_seq, pad_to - rows
            fill = np.full(pad, _PAD_INPUT, dtype=np.int64)
            input_ids, positions = np.concatenate([input_ids, fill]), np.concatenate([positions, fill])
            # varlen: pad_block is set with the KV cache
            slots = np.concatenate([slots, np.full(pad, cast(int, self.pad_block) * self.block_size, np.int64)])
            logits_indices = np.concatenate([logits_indices, np.arange(len(logits_indices), pad_to)])
            seq_lens, query_lens = seq_lens + [1] * pad, query_lens + [1] * pad  # new lists: the step's stay
        tables = np.full((rows + pad, width), pad_value, dtype=np.int64)
        gathered = self.input_batch.gather(step.table_rows, width)
        held = np.arange(width) < self.input_batch.num_blocks[step.table_rows][:, None]
        tables[:rows] = np.where(held, gathered, pad_value)
        self._stage_flat_lists(batch, input_ids, positions, slots, logits_indices)
        batch.add("block_tables", tables, torch.int32, tables.shape)
        batch.add("seq_lens", seq_lens, torch.int32)
        batch.add("query_start_loc", np.concatenate(([0], np.cumsum(query_lens))), torch.int32)
        if self.lora_manager is not None:  # padding rows: the base model
            batch.add("lora_slots", np.concatenate([self._lora_token_slots(step), np.full(pad, NO_LORA)]), torch.int32)
        return batch

    @staticmethod
    def _stage_flat_lists(batch: StagedBatch, input_ids, positions, slots, logits_indices) -> None:
        batch.add("input_ids", input_ids, torch.long)
        batch.add("positions", positions, torch.long)
        batch.add("slot_mapping", slots, torch.long)
        batch.add("logits_indices", logits_indices, torch.long)

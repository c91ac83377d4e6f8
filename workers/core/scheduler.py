"""Iteration-level scheduling: every step builds a new batch under one
token budget, running sequences first, then waiting ones. After the step,
update_from_output advances the sequences: the one place their progress
and status change."""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass, field

from shoal.workers.core.block_manager import BlockManager
from shoal.workers.core.kv_connector import SchedulerConnector
from shoal.workers.core.lora_slots import LoRASlotTable
from shoal.workers.core.outputs import KVConnectorOutput, ModelRunnerOutput
from shoal.workers.core.sequence import PLACEHOLDER_TOKEN_ID, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int  # the token budget of one step
    max_num_seqs: int  # sequences in one step at most
    # Prefill under a queue of prompts (vLLM's names). A prompt with more than
    # long_prefill_token_threshold tokens left to prefill is long, and no
    # prompt prefills more than that in one step (0: off). At most
    # max_num_partial_prefills prompts are left part-prefilled by a step, of
    # which max_long_partial_prefills long ones: a prompt past either limit
    # waits, and shorter prompts behind it may go first.
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.max_num_partial_prefills < 1:
            raise ValueError(f"max_num_partial_prefills must be >= 1, got {self.max_num_partial_prefills}")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ValueError(
                f"max_long_partial_prefills must be in 1..max_num_partial_prefills ({self.max_num_partial_prefills}), "
                f"got {self.max_long_partial_prefills}"
            )


@dataclass(slots=True)
class SchedulerOutput:
    """The step's batch: each sequence with its number of new tokens, which
    run from its num_computed_tokens. A decode has 1, a prefill chunk more."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # The constrained rows' token masks (structured_output/manager.py GrammarBitmask), made on rank 0
    # by the engine once the batch is known; only rank 0 samples, so no other rank is sent it.
    grammar_bitmask: object | None = None
    # slot -> LoRARequest of every adapter the scheduled sequences run under (the runner fills the slots)
    lora_slots: dict = field(default_factory=dict)
    # The KV connector's moves for this step (kv_transfer/), made by every rank before its forward.
    kv_connector_metadata: object | None = None
    # How long the connector may wait for a load to land (a pass with nothing else to do).
    kv_wait_s: float = 0.0

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @staticmethod
    def due_token(seq, num_new_tokens: int) -> bool:
        """Whether the step computes seq's last token, so samples its next
        (seq: a Sequence, or a tensor-parallel rank's mirror of one)."""
        return seq.num_computed_tokens + num_new_tokens == len(seq.token_ids)

    @property
    def seqs_due_token(self) -> list[Sequence]:
        """The scheduled sequences due a token, in the scheduler's order."""
        return [seq for seq, n in self.scheduled if self.due_token(seq, n)]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: list[int],
        lora_table: LoRASlotTable | None = None,
        connector: SchedulerConnector | None = None,
    ):
        self.config = config
        # vLLM's default: with several partial prefills, a prompt over 4% of the model length is long.
        self.long_prefill_threshold = config.long_prefill_token_threshold or (
            max(1, int(max_model_len * 0.04)) if config.max_num_partial_prefills > 1 else 0
        )
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        # (priority, arrival_order, seq): arrival_order is unique, so the
        # Sequence itself is never compared. A preempted sequence keeps its
        # place, so it goes back ahead of later arrivals.
        self.waiting: list[tuple[int, int, Sequence]] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # parent_request_id -> the group's unfinished members, in arrival order (parallel sampling)
        self.groups: dict[str, list[Sequence]] = {}
        # Which adapter is in which device slot (LoRA, else None); a waiting sequence whose adapter
        # cannot have a slot this step (every slot held by running sequences) stays waiting.
        self.lora_table = lora_table
        self.num_waiting_for_lora = 0  # such sequences in the last schedule()
        # The KV connector's scheduler side (kv_transfer/): a new request's blocks past its
        # device prefix hits may come from a slower tier, and evicted blocks go to one.
        self.connector = connector
        if connector is not None:
            block_manager.pool.on_evict = connector.on_block_evicted
        # request_id -> (seq, its tokens on their way): sequences WAITING_FOR_REMOTE_KVS, whose
        # blocks past their prefix hits a connector loads across steps; they hold their blocks
        # and no step's budget. One that ends meanwhile keeps its blocks until the load is done.
        self.loading: dict[str, tuple[Sequence, int]] = {}
        # request_id -> seq: ended sequences whose blocks a connector still reads (its
        # request_finished said free later), freed when get_finished names them.
        self.sending: dict[str, Sequence] = {}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.loading)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting_tokens(self) -> int:
        """Prompt tokens still to prefill before the queue is through: each
        waiting request's (less the prefix the cache held when it arrived)
        and the rest of running ones' chunked prompts. The request router
        weighs a queue by it. Read from other threads: it works on copies."""
        n = sum(min(s.num_expected_prefill, s.num_tokens - s.num_computed_tokens) for _, _, s in list(self.waiting))
        return n + sum(r for s in list(self.running) if (r := s.num_tokens - s.num_computed_tokens) > 1)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def add(self, seq: Sequence) -> None:
        if seq.num_computed_tokens == 0 and not seq.num_expected_prefill:  # a new arrival, not a preempted one
            bs = self.block_manager.block_size
            hits = len(self.block_manager.get_computed_blocks(seq))  # hashes the prompt once; scheduling reuses them
            if seq.parent_request_id is not None:
                members = self.groups.setdefault(seq.parent_request_id, [])
                if members:  # a sibling: it will take the prompt's full blocks from the first
                    hits = (seq.num_tokens - 1) // bs
                members.append(seq)
            seq.num_expected_prefill = seq.num_tokens - hits * bs
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self.waiting, (seq.priority, seq.arrival_order, seq))

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End seq (stop, length or abort) and free its blocks at once."""
        free_later = False
        if self.connector is not None and reason != "error":  # a failed request's blocks are not trusted
            free_later, seq.kv_transfer_params = self.connector.request_finished(seq, seq.block_table)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting = [w for w in self.waiting if w[2] is not seq]
            heapq.heapify(self.waiting)
        if seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS:
            pass  # its blocks are being written: update_from_kv_output frees them once the load is done
        elif free_later and seq.block_table:
            self.sending[seq.request_id] = seq  # being read: update_from_kv_output frees them once sent
        else:
            self._free(seq)
        if (members := self.groups.get(seq.parent_request_id)) is not None:
            members[:] = [m for m in members if m is not seq]
            if not members:
                del self.groups[seq.parent_request_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.timings.finished = time.time()
        seq.drop_placeholders()  # a step in flight computes a token it will never have

    def _free(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0  # none of its keys and values are cached for it now
        if seq.lora_slot is not None:  # its adapter's slot may be given to another now
            self.lora_table.release(seq.lora_request)
            seq.lora_slot = None

    def _preempt(self, seq: Sequence) -> None:
        # Recompute, not swap: drop the KV and prefill it again later (the
        # prefix cache often still holds most of it).
        self.running.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.timings.preempted.append(time.time())
        heapq.heappush(self.waiting, (seq.priority, seq.arrival_order, seq))
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        picked: dict[int, tuple[Sequence, int]] = {}  # id(seq) -> (seq, n), in order
        bm = self.block_manager
        threshold = self.long_prefill_threshold
        partial = [0, 0]  # prompts this step leaves part-prefilled: all, long ones

        # Running sequences: decodes first, so a long prefill chunk never
        # takes the budget that in-flight replies need.
        order = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_output_placeholders and self._ends_by_length(seq):
                continue  # the step in flight gives it its last token
            left = seq.num_tokens - seq.num_computed_tokens
            n = min(left, budget, threshold) if threshold and left > 1 else min(left, budget)
            while not bm.allocate_slots(seq, n):
                victim = max(self.running, key=Sequence.sort_key)
                self._preempt(victim)
                out.preempted.append(victim)
                if id(victim) in picked:
                    budget += picked.pop(id(victim))[1]
                if victim is seq:
                    break
            else:
                picked[id(seq)] = (seq, n)
                budget -= n
        for seq, n in picked.values():  # a running prefill goes on whatever the limits (it holds its blocks)
            self._count_partial(partial, seq.num_tokens - seq.num_computed_tokens, n)
        out.scheduled = list(picked.values())
        this_step = {id(s): n for s, n in out.scheduled}  # tokens each sequence computes in this step

        # Waiting sequences, in (priority, arrival) order; none join in a
        # step that had to preempt, since memory is short. A parallel-sampling
        # sibling is held (set aside) until a member's prompt is computed by
        # the end of this step: one prefill, not n.
        held = []
        self.num_waiting_for_lora = 0
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0][2]
            if seq.block_table:  # a connector's load landed: its blocks are in place, and counted
                if not self._admit(seq, [], 0, budget, threshold, partial, out, this_step):
                    break
                budget -= this_step[id(seq)]
                continue
            donor = None
            if seq.parent_request_id is not None:
                wait, donor, ready = self._sibling_source(seq, this_step)
                if wait:
                    held.append(heapq.heappop(self.waiting))
                    continue
            if seq.lora_request is not None:
                seq.lora_slot = self.lora_table.acquire(seq.lora_request)
                if seq.lora_slot is None:  # every slot is held: it waits, and later arrivals may go
                    self.num_waiting_for_lora += 1
                    held.append(heapq.heappop(self.waiting))
                    continue
            hits = bm.get_computed_blocks(seq)
            if donor is not None and len(shared := bm.shared_blocks(seq, donor, ready)) > len(hits):
                hits = shared  # the cache is off, or did not keep them all
            num_external, load_async = 0, False
            if self.connector is not None:
                matched, load_async = self.connector.get_num_new_matched_tokens(seq, len(hits) * bm.block_size)
                if matched is None:  # the connector is still finding out: it waits, and later arrivals may go
                    self._release_lora(seq)
                    held.append(heapq.heappop(self.waiting))
                    continue
                num_external = matched
            if load_async and num_external:
                if not bm.allocate_slots(seq, 0, hits, num_external, external_pending=True):
                    self._release_lora(seq)
                    break
                heapq.heappop(self.waiting)
                seq.num_computed_tokens = len(hits) * bm.block_size
                self.connector.update_state_after_alloc(seq, seq.block_table[len(hits) :], num_external)
                self._release_lora(seq)  # taken again when it runs
                seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
                self.loading[seq.request_id] = (seq, num_external)
                continue
            left = seq.num_tokens - len(hits) * bm.block_size - num_external
            n = min(left, budget, threshold) if threshold else min(left, budget)
            if n < left and (
                partial[0] >= self.config.max_num_partial_prefills
                or (threshold and left > threshold and partial[1] >= self.config.max_long_partial_prefills)
            ):  # past the partial-prefill limits: it waits, and shorter prompts behind it may go
                if seq.lora_slot is not None:
                    self.lora_table.release(seq.lora_request)
                    seq.lora_slot = None
                held.append(heapq.heappop(self.waiting))
                continue
            if not bm.allocate_slots(seq, n, hits, num_external):
                if seq.lora_slot is not None:
                    self.lora_table.release(seq.lora_request)
                    seq.lora_slot = None
                break
            heapq.heappop(self.waiting)
            seq.num_computed_tokens = len(hits) * bm.block_size + num_external  # the prefix hits, every tier's
            if self.connector is not None:
                self.connector.update_state_after_alloc(seq, seq.block_table[len(hits) :], num_external)
            if seq.timings.first_scheduled is None:
                seq.timings.first_scheduled = time.time()
                seq.num_cached_tokens = seq.num_computed_tokens
            elif seq.status is SequenceStatus.PREEMPTED:
                seq.timings.resumed.append(time.time())
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            this_step[id(seq)] = n
            budget -= n
            self._count_partial(partial, left, n)
        for item in held:
            heapq.heappush(self.waiting, item)
        out.lora_slots = {s.lora_slot: s.lora_request for s, _ in out.scheduled if s.lora_slot is not None}
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _admit(
        self,
        seq: Sequence,
        hits: list[int],
        num_external: int,
        budget: int,
        threshold: int,
        partial: list[int],
        out: SchedulerOutput,
        this_step: dict[int, int],
    ) -> bool:
        """Schedule waiting seq, whose computed tokens are counted already (a
        landed load): False, changing nothing, if blocks run short."""
        left = seq.num_tokens - seq.num_computed_tokens
        n = min(left, budget, threshold) if threshold else min(left, budget)
        if seq.lora_request is not None and seq.lora_slot is None:
            seq.lora_slot = self.lora_table.acquire(seq.lora_request)
            if seq.lora_slot is None:
                return False
        if not self.block_manager.allocate_slots(seq, n):
            self._release_lora(seq)
            return False
        heapq.heappop(self.waiting)
        if seq.timings.first_scheduled is None:
            seq.timings.first_scheduled = time.time()
            seq.num_cached_tokens = seq.num_computed_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append((seq, n))
        this_step[id(seq)] = n
        self._count_partial(partial, left, n)
        return True

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_slot is not None:
            self.lora_table.release(seq.lora_request)
            seq.lora_slot = None

    def update_from_kv_output(self, kv_output: KVConnectorOutput | None) -> None:
        """Loads that landed: their sequences wait again, their blocks counted
        as computed (or, where a load failed, computed by the prefill: the
        same tokens as if no tier had held them). A sequence that ended
        while loading frees its blocks now."""
        if kv_output is None or kv_output.is_empty:
            return
        if self.connector is not None:
            self.connector.update_connector_output(kv_output)
        for request_id in kv_output.finished_sending:
            if (sent := self.sending.pop(request_id, None)) is not None:
                self._free(sent)
        for request_id in kv_output.finished_recving | kv_output.failed_recving:
            entry = self.loading.pop(request_id, None)
            if entry is None:
                continue
            seq, num_external = entry
            if seq.status is SequenceStatus.FINISHED:
                self._free(seq)
                continue
            if request_id not in kv_output.failed_recving:
                self.block_manager.commit_external(seq, num_external)
            seq.status = SequenceStatus.WAITING
            heapq.heappush(self.waiting, (seq.priority, seq.arrival_order, seq))

    def _count_partial(self, partial: list[int], left: int, n: int) -> None:
        """Count a scheduled prefill of n of its `left` tokens in partial ([all, long])."""
        if n < left:
            partial[0] += 1
            if self.long_prefill_threshold and left > self.long_prefill_threshold:
                partial[1] += 1

    def _sibling_source(self, seq: Sequence, this_step: dict[int, int]) -> tuple[bool, Sequence | None, int]:
        """(whether seq waits, the member whose blocks it may take, that
        member's tokens computed by the end of this step). A running member
        whose prompt is computed by then gives its blocks: seq joins the step
        that completes the prompt (each layer writes the whole batch's keys
        and values before any attention reads them). Without one, every
        member but the group's first waits (for that one's prefill, which
        never waits on them: a group whose first member finishes has a new first)."""
        members = self.groups.get(seq.parent_request_id, ())
        for m in members:
            ready = m.num_computed_tokens + this_step.get(id(m), 0)
            if m is not seq and m.status is SequenceStatus.RUNNING and ready >= m.num_prompt_tokens:
                return False, m, ready
        return bool(members) and members[0] is not seq, None, 0

    # ---- async scheduling: the next step scheduled while this one computes ----

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether seq's tokens so far, placeholders counted, reach a length cap."""
        return seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len

    @staticmethod
    def advance_ahead(sched: SchedulerOutput) -> None:
        """A step is computing: count its tokens computed now, and give each
        sequence due a token a placeholder for it, so that the next step can
        be scheduled at once (vLLM's async scheduling). update_from_output(ahead=True)
        puts the sampled tokens in their places."""
        for seq, n in sched.scheduled:
            due = SchedulerOutput.due_token(seq, n)
            seq.num_computed_tokens += n
            if due:
                seq.token_ids.append(PLACEHOLDER_TOKEN_ID)
                seq.num_output_placeholders += 1

    @staticmethod
    def undo_ahead(sched: SchedulerOutput) -> None:
        """The step advance_ahead counted failed: its sequences are as
        scheduled again (the next step computes the same tokens). Only the
        step's own placeholders are there: the next was not launched."""
        for seq, n in sched.scheduled:
            if seq.status is SequenceStatus.RUNNING:  # (one preempted since holds no tokens computed)
                seq.num_computed_tokens -= n
            seq.drop_placeholders()

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
        stop_strings: list[str | None] | None = None,
        ahead: bool = False,
    ) -> list[Sequence]:
        """Advance the sequences by the step that ran: the scheduled tokens
        are computed, each sampled token is appended, and a sequence that
        reached a stop finishes. stop_strings[i]: the stop string that the
        engine's detokenizer found in row i's text, if any. ahead: the step
        was counted by advance_ahead, so its tokens replace their
        placeholders, and a sequence that ended since (aborted, or ended by
        the step before) has no row. Returns the sequences that finished, in order."""
        if not ahead:
            for seq, n in scheduler_output.scheduled:
                seq.num_computed_tokens += n
        now = time.time()
        out = model_runner_output
        finished = []
        for seq, token, stop_string in zip(out.seqs, out.sampled_token_ids, stop_strings or [None] * len(out.seqs)):
            if ahead:
                if seq.status is SequenceStatus.FINISHED:
                    continue
                seq.token_ids[len(seq.token_ids) - seq.num_output_placeholders] = token
                seq.num_output_placeholders -= 1
            else:
                seq.token_ids.append(token)
            if seq.timings.first_token is None:
                seq.timings.first_token = now
            grammar_done = False
            if (sor := seq.structured_output_request) is not None and token not in self.eos_token_ids:
                if not sor.grammar.accept_tokens([token]):  # the mask allowed it: a bug, never the client's
                    logger.error("request %s: its grammar refused sampled token %d", seq.request_id, token)
                    self.finish(seq, "abort")
                    finished.append(seq)
                    continue
                grammar_done = sor.grammar.is_terminated()
            reason, stop_reason = self._check_stop(seq, token, stop_string, grammar_done)
            if reason is not None:
                self.finish(seq, reason, stop_reason)
                finished.append(seq)
        return finished

    def _check_stop(
        self, seq: Sequence, token: int, stop_string: str | None, grammar_done: bool = False
    ) -> tuple[str | None, str | int | None]:
        """(finish reason, stop reason) after token was appended: a stop
        token, then eos, then a stop string, all from min_tokens on; then a
        grammar that nothing more can follow (whatever min_tokens says: no
        token is left to sample); then the length caps."""
        p = seq.params
        num_output = seq.num_sampled_tokens  # (a step in flight may hold a placeholder past token)
        if num_output >= p.min_tokens:
            if token in p.stop_token_ids:
                return "stop", token
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if stop_string is not None:
                return "stop", stop_string
        if grammar_done:
            return "stop", None
        if num_output >= p.max_tokens or seq.num_prompt_tokens + num_output >= self.max_model_len:
            return "length", None
        return None, None

"""What rank 0 sends the other tensor-parallel ranks each step, compactly.

The scheduler runs on rank 0 only. The other ranks keep a mirror of each
running sequence (tokens, computed count, block table) and are sent, per
step, only what changed: a sequence seen for the first time (or again after
preemption) comes whole; after that only its newly sampled tokens and newly
allocated blocks, as in vLLM v1's NewRequestData / CachedRequestData.
Each rank advances its mirrors' computed counts itself after the step; a
count that rank 0 set back (a step whose KV loads failed ran no forward)
is sent again.
Under LoRA a sequence comes with its adapter's slot (fixed until it is
preempted, when it comes whole again), and each step with the adapters its
slots must hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.workers.core.scheduler import SchedulerOutput
from shoal.workers.core.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class NewSeqData:
    seq_id: int
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    lora_slot: int | None = None


@dataclass(slots=True)
class StepInput:
    scheduled: list[tuple[int, int]]  # (seq id, new tokens), in the scheduler's order
    new_seqs: list[NewSeqData] = field(default_factory=list)
    new_token_ids: dict[int, list[int]] = field(default_factory=dict)  # since last sent
    new_block_ids: dict[int, list[int]] = field(default_factory=dict)  # since last sent
    finished: list[int] = field(default_factory=list)  # forget these (ended or preempted)
    lora_slots: dict = field(default_factory=dict)  # slot -> LoRARequest (SchedulerOutput.lora_slots)
    lora_adapters: dict = field(default_factory=dict)  # slot -> LoRAAdapter, for the slots this step changes
    # The KV connector's moves (SchedulerOutput.kv_connector_metadata): every rank makes them on its slice.
    kv_connector_metadata: object | None = None
    kv_wait_s: float = 0.0  # how long the connector may wait for a load to land (SchedulerOutput.kv_wait_s)
    # Computed counts that are not what the mirrors made them: after a step that ran no
    # forward (its KV loads failed), rank 0's sequences went back and the mirrors went on.
    num_computed: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Sent:
    seq: Sequence
    num_tokens: int
    num_blocks: int
    num_computed: int  # the mirror's, once it has run the step last sent


class StepInputEncoder:
    """Rank 0's side: remembers what each mirror holds."""

    def __init__(self):
        self.sent: dict[int, _Sent] = {}

    def encode(self, sched: SchedulerOutput) -> StepInput:
        step = StepInput(
            [(seq.arrival_order, n) for seq, n in sched.scheduled],
            lora_slots=sched.lora_slots,
            kv_connector_metadata=sched.kv_connector_metadata,
            kv_wait_s=sched.kv_wait_s,
        )
        # Preempted sequences lost their blocks; finished ones are gone.
        gone = {seq.arrival_order for seq in sched.preempted}
        gone |= {sid for sid, s in self.sent.items() if s.seq.status is SequenceStatus.FINISHED}
        for sid in gone:
            if self.sent.pop(sid, None) is not None:
                step.finished.append(sid)
        for seq, n in sched.scheduled:
            sid, s = seq.arrival_order, self.sent.get(seq.arrival_order)
            if s is None:
                step.new_seqs.append(
                    NewSeqData(sid, list(seq.token_ids), list(seq.block_table), seq.num_computed_tokens, seq.lora_slot)
                )
                self.sent[sid] = _Sent(seq, seq.num_tokens, len(seq.block_table), seq.num_computed_tokens + n)
                continue
            if seq.num_computed_tokens != s.num_computed:
                step.num_computed[sid] = seq.num_computed_tokens
            s.num_computed = seq.num_computed_tokens + n
            if seq.num_tokens > s.num_tokens:
                step.new_token_ids[sid] = seq.token_ids[s.num_tokens :]
                s.num_tokens = seq.num_tokens
            if len(seq.block_table) > s.num_blocks:
                step.new_block_ids[sid] = seq.block_table[s.num_blocks :]
                s.num_blocks = len(seq.block_table)
        return step


@dataclass(slots=True)
class SeqMirror:
    """A sequence as the other ranks see it: enough to build the batch."""

    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    lora_slot: int | None = None


class StepInputDecoder:
    """The other ranks' side: applies each step to the mirrors, the one
    owner of their state there."""

    def __init__(self):
        self.seqs: dict[int, SeqMirror] = {}

    def decode(self, step: StepInput) -> list[tuple[SeqMirror, int]]:
        for sid in step.finished:
            del self.seqs[sid]
        for new in step.new_seqs:
            self.seqs[new.seq_id] = SeqMirror(new.token_ids, new.block_table, new.num_computed_tokens, new.lora_slot)
        for sid, tokens in step.new_token_ids.items():
            self.seqs[sid].token_ids.extend(tokens)
        for sid, blocks in step.new_block_ids.items():
            self.seqs[sid].block_table.extend(blocks)
        for sid, num_computed in step.num_computed.items():
            self.seqs[sid].num_computed_tokens = num_computed
        return [(self.seqs[sid], n) for sid, n in step.scheduled]

    def advance(self, scheduled: list[tuple[SeqMirror, int]]) -> None:
        """The step decode() returned has run: its new tokens are computed."""
        for mirror, n in scheduled:
            mirror.num_computed_tokens += n

"""A step's SamplingMetadata, built from the sequences due a token: the
per-request settings become per-row tensors for the sampler."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shoal.workers.core.sampling_params import SamplingParams
from shoal.workers.core.sequence import Sequence
from shoal.workers.model_executor.layers.sampling_metadata import SamplingMetadata
from shoal.workers.model_executor.staging_buffer import StagedBatch


def build_sampling_metadata(seqs: list[Sequence], eos_token_ids: list[int], vocab_size: int,
                            device: torch.device) -> SamplingMetadata:  # fmt: skip
    random_rows: list[int] = []
    repetition_rows: list[int] = []
    frequency_rows: list[int] = []
    banned: list[tuple[int, int]] = []
    num_logprobs: dict[int, int] = {}
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.greedy:
            random_rows.append(i)
        if p.repetition_penalty != 1.0:
            repetition_rows.append(i)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            frequency_rows.append(i)  # nothing to count before the first output token
        if seq.num_output_tokens < p.min_tokens:
            banned += [(i, t) for t in p.stop_token_ids + ([] if p.ignore_eos else eos_token_ids)]
        if p.logprobs is not None:
            num_logprobs[i] = p.logprobs

    def per_row(rows: list[int], value: Callable[[SamplingParams], float | int]) -> torch.Tensor | None:
        return as_tensor([value(seqs[i].params) for i in rows])

    def as_tensor(values: list) -> torch.Tensor | None:
        return torch.tensor(values, device=device) if values else None

    def counts(lists: list[list[int]]) -> torch.Tensor | None:
        return _token_counts(lists, vocab_size, device) if lists else None

    def if_any(uses: Callable[[SamplingParams], bool]) -> list[int]:
        # A filter that one random row uses runs on them all, the others
        # with their "off" value (top_p 1.0 can still cut the tail where
        # rounding takes the mass to 1: kept, for the same tokens).
        return random_rows if any(uses(seqs[i].params) for i in random_rows) else []

    filtered = if_any(lambda p: p.top_k > 0 or p.top_p < 1.0)
    seen = counts([seqs[i].token_ids for i in repetition_rows])
    return SamplingMetadata(
        random_rows=random_rows,
        temperature=per_row(random_rows, lambda p: p.temperature),
        top_k=per_row(filtered, lambda p: p.top_k if p.top_k > 0 else vocab_size),
        top_p=per_row(filtered, lambda p: p.top_p),
        min_p=per_row(if_any(lambda p: p.min_p > 0), lambda p: p.min_p),
        generators={i: seqs[i].generator for i in random_rows if seqs[i].generator is not None},
        repetition_rows=as_tensor(repetition_rows),
        repetition_penalties=per_row(repetition_rows, lambda p: p.repetition_penalty),
        seen_mask=None if seen is None else seen > 0,
        frequency_rows=as_tensor(frequency_rows),
        frequency_penalties=per_row(frequency_rows, lambda p: p.frequency_penalty),
        presence_penalties=per_row(frequency_rows, lambda p: p.presence_penalty),
        output_token_counts=counts([seqs[i].output_token_ids for i in frequency_rows]),
        banned_rows=as_tensor([i for i, _ in banned]),
        banned_token_ids=as_tensor([t for _, t in banned]),
        num_logprobs=num_logprobs,
    )


def _token_counts(lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(lists), vocab_size]: how often each list holds each token."""
    flat = torch.cat([torch.tensor(ids, dtype=torch.long) + j * vocab_size for j, ids in enumerate(lists)])
    return torch.bincount(flat.to(device), minlength=len(lists) * vocab_size).view(len(lists), vocab_size)


class PendingSamplingMetadata:
    """A step's sampling inputs, staged with the step's other inputs; the
    metadata exists once the batch is uploaded."""

    def __init__(self, seqs: list[Sequence], eos_token_ids: list[int], vocab_size: int):
        self._args = (seqs, eos_token_ids, vocab_size)

    def resolve(self, tensors: dict[str, torch.Tensor], device: torch.device) -> SamplingMetadata:
        return build_sampling_metadata(*self._args, device)


def stage_sampling_metadata(seqs: list[Sequence], eos_token_ids: list[int], vocab_size: int,
                            batch: StagedBatch) -> PendingSamplingMetadata:  # fmt: skip
    """Adds the rows' sampling inputs to `batch` (names prefixed "sampling.");
    resolve the result with batch.upload()'s tensors."""
    return PendingSamplingMetadata(seqs, eos_token_ids, vocab_size)

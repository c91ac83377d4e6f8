"""A step's SamplingMetadata, built from the sequences due a token: the
per-request settings are staged with the step's other inputs (names
prefixed "sampling."), ride in its one host-to-device copy, and become the
sampler's per-row tensors on the device."""

from __future__ import annotations

import random
from collections.abc import Callable
from itertools import chain

import numpy as np
import torch

from shoal.proto.logit_bias import LogitBias
from shoal.workers.core.sequence import Sequence
from shoal.workers.model_executor.runner.staging_buffer import StagedBatch, StagingBuffer
from shoal.workers.model_executor.sampling.metadata import SamplingMetadata
from shoal.workers.model_executor.sampling.noise import as_int64_seed

_PREFIX = "sampling."


class PendingSamplingMetadata:
    """A step's sampling inputs, staged with the step's other inputs; the
    metadata exists once the batch is uploaded. Holds what the host must
    know: row counts, and the logprob counts it trims the results by."""

    def __init__(self, vocab_size: int, num_random: int, num_tokens: dict[str, int], num_logprobs: dict[int, int]):
        self.vocab_size, self.num_random, self.num_logprobs = vocab_size, num_random, num_logprobs
        self._num_tokens = num_tokens  # "seen" / "output" -> how many token ids were staged

    def resolve(self, tensors: dict[str, torch.Tensor], device: torch.device) -> SamplingMetadata:
        def get(name: str) -> torch.Tensor | None:
            return tensors.get(_PREFIX + name)

        return SamplingMetadata(
            random_rows=get("random_rows"),
            num_random=self.num_random,
            temperature=get("temperature"),
            top_k=get("top_k"),
            top_p=get("top_p"),
            min_p=get("min_p"),
            seeds=get("seeds"),
            output_index=get("output_index"),
            repetition_rows=get("repetition_rows"),
            repetition_penalties=get("repetition_penalties"),
            seen_mask=self._token_counts("seen", get, torch.bool),
            frequency_rows=get("frequency_rows"),
            frequency_penalties=get("frequency_penalties"),
            presence_penalties=get("presence_penalties"),
            output_token_counts=self._token_counts("output", get, torch.int64),
            banned_rows=get("banned_rows"),
            banned_token_ids=get("banned_token_ids"),
            bias_rows=get("bias_rows"),
            bias_token_ids=get("bias_token_ids"),
            bias_values=get("bias_values"),
            grammar_rows=get("grammar_rows"),
            grammar_bitmask=get("grammar_bitmask"),
            logprob_rows=get("logprob_rows"),
            num_logprobs=self.num_logprobs,
        )

    def _token_counts(self, kind: str, get: Callable, dtype: torch.dtype) -> torch.Tensor | None:
        """[rows, vocab]: per row, how often (bool: whether) its staged list
        holds each token. index_add_ rather than bincount: CUDA's bincount
        reads the max back to the host."""
        lengths = get(kind + "_lengths")
        if lengths is None:
            return None
        ids, rows, vocab = get(kind + "_token_ids"), lengths.shape[0], self.vocab_size
        offsets = torch.arange(rows, device=ids.device) * vocab
        flat = ids + torch.repeat_interleave(offsets, lengths, output_size=self._num_tokens[kind])
        out = torch.zeros(rows * vocab, dtype=dtype, device=ids.device)
        if dtype == torch.bool:
            return out.index_fill_(0, flat, True).view(rows, vocab)
        return out.index_add_(0, flat, torch.ones_like(flat)).view(rows, vocab)


class _RowKinds:
    """Which rows need what, from one pass over the sequences."""

    def __init__(self, seqs: list[Sequence], eos_token_ids: list[int], grammar_bitmask=None):
        self.random_rows: list[int] = []
        # (row, its row of the grammar bitmask): the constrained rows
        self.grammar: list[tuple[int, int]] = []
        if grammar_bitmask is not None:
            where = grammar_bitmask.rows
            self.grammar = [(i, where[id(s)]) for i, s in enumerate(seqs) if id(s) in where]
        self.grammar_bitmask = grammar_bitmask
        self.repetition_rows: list[int] = []
        self.frequency_rows: list[int] = []
        self.banned: list[tuple[int, int]] = []
        self.bias_rows: list[int] = []  # rows with a logit_bias: their arrays are staged whole
        self.num_logprobs: dict[int, int] = {}
        for i, seq in enumerate(seqs):
            p = seq.params
            if not p.greedy:
                self.random_rows.append(i)
            if p.repetition_penalty != 1.0:
                self.repetition_rows.append(i)
            if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
                self.frequency_rows.append(i)  # nothing to count before the first output token
            if p.min_tokens and seq.num_output_tokens < p.min_tokens:
                self.banned += [(i, t) for t in p.stop_token_ids + ([] if p.ignore_eos else eos_token_ids)]
            if p.logit_bias:
                self.bias_rows.append(i)
            if p.logprobs is not None:
                self.num_logprobs[i] = p.logprobs

    @property
    def plain_greedy(self) -> bool:
        """Argmax alone: nothing to stage."""
        return not (
            self.random_rows
            or self.repetition_rows
            or self.frequency_rows
            or self.banned
            or self.bias_rows
            or self.grammar
            or self.num_logprobs
        )


def stage_sampling_metadata(
    seqs: list[Sequence], eos_token_ids: list[int], vocab_size: int, batch: StagedBatch, grammar_bitmask=None
) -> PendingSamplingMetadata:
    """Adds the rows' sampling inputs to `batch` (names prefixed "sampling.");
    resolve the result with batch.upload()'s tensors. Only what some row
    uses is staged: a plain greedy batch stages nothing. grammar_bitmask:
    the constrained rows' token masks (structured_output GrammarBitmask)."""
    return _stage(_RowKinds(seqs, eos_token_ids, grammar_bitmask), seqs, vocab_size, batch)


def _stage(kinds: _RowKinds, seqs: list[Sequence], vocab_size: int, batch: StagedBatch) -> PendingSamplingMetadata:
    num_tokens: dict[str, int] = {}  # "seen" / "output" -> how many token ids were staged
    f32, i64 = torch.float32, torch.int64

    def add(name: str, values, dtype: torch.dtype) -> None:
        batch.add(_PREFIX + name, values, dtype)

    def add_tokens(kind: str, lists: list[list[int]]) -> None:
        num_tokens[kind] = n = sum(map(len, lists))
        add(kind + "_lengths", [len(ids) for ids in lists], i64)
        add(kind + "_token_ids", np.fromiter(chain.from_iterable(lists), np.int64, n), i64)

    if rows := kinds.random_rows:
        params = [seqs[i].params for i in rows]
        add("random_rows", rows, i64)
        add("temperature", [p.temperature for p in params], f32)
        # A filter that one random row uses runs on them all, the others
        # with their "off" value (top_p 1.0 can still cut the tail where
        # rounding takes the mass to 1: kept, for the same tokens).
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            # top_k past the vocabulary keeps every token (and must not overflow int64)
            add("top_k", [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], i64)
            add("top_p", [p.top_p for p in params], f32)
        if any(p.min_p > 0 for p in params):
            add("min_p", [p.min_p for p in params], f32)
        add("seeds", [as_int64_seed(_seed_of(seqs[i])) for i in rows], i64)
        add("output_index", [seqs[i].num_output_tokens for i in rows], i64)
    if rows := kinds.repetition_rows:
        add("repetition_rows", rows, i64)
        add("repetition_penalties", [seqs[i].params.repetition_penalty for i in rows], f32)
        add_tokens("seen", [seqs[i].token_ids for i in rows])
    if rows := kinds.frequency_rows:
        add("frequency_rows", rows, i64)
        add("frequency_penalties", [seqs[i].params.frequency_penalty for i in rows], f32)
        add("presence_penalties", [seqs[i].params.presence_penalty for i in rows], f32)
        add_tokens("output", [seqs[i].output_token_ids for i in rows])
    if kinds.banned:
        add("banned_rows", [i for i, _ in kinds.banned], i64)
        add("banned_token_ids", [t for _, t in kinds.banned], i64)
    if rows := kinds.bias_rows:
        # Each request's arrays, made once when it was checked (LogitBias), joined in C:
        # no Python work per entry, per step.
        biases = [_logit_bias(seqs[i].params) for i in rows]
        add("bias_rows", np.repeat(np.asarray(rows, np.int64), [len(b) for b in biases]), i64)
        add("bias_token_ids", np.concatenate([b.token_ids for b in biases]), i64)
        add("bias_values", np.concatenate([b.values for b in biases]), f32)
    if kinds.grammar:
        masks = kinds.grammar_bitmask.bitmask[[k for _, k in kinds.grammar]]  # in the rows' order
        add("grammar_rows", [i for i, _ in kinds.grammar], i64)
        batch.add(_PREFIX + "grammar_bitmask", masks, torch.int32, masks.shape)
    if kinds.num_logprobs:
        add("logprob_rows", list(kinds.num_logprobs), i64)
    return PendingSamplingMetadata(vocab_size, len(kinds.random_rows), num_tokens, kinds.num_logprobs)


def _logit_bias(params) -> LogitBias:
    bias = params.logit_bias
    if type(bias) is not LogitBias:  # set past SamplingParams' check (a test's Sequence): checked now, once
        bias = params.logit_bias = LogitBias(bias)
    return bias


def _seed_of(seq: Sequence) -> int:
    # The engine gives every sampled request a seed; a sequence made
    # elsewhere without one samples unseeded, a fresh seed each step.
    return seq.sampling_seed if seq.sampling_seed is not None else random.getrandbits(63)


def build_sampling_metadata(
    seqs: list[Sequence], eos_token_ids: list[int], vocab_size: int, device: torch.device, grammar_bitmask=None
) -> SamplingMetadata:
    """Stage, upload and resolve in one go, in a batch of its own (none
    for a plain greedy batch: nothing to copy)."""
    kinds = _RowKinds(seqs, eos_token_ids, grammar_bitmask)
    if kinds.plain_greedy:
        return PendingSamplingMetadata(vocab_size, 0, {}, {}).resolve({}, device)
    batch = StagingBuffer(device, initial_bytes=0).begin()
    pending = _stage(kinds, seqs, vocab_size, batch)
    return pending.resolve(batch.upload(), device)

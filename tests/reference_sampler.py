"""The sampler as it was before it took SamplingMetadata: one row per
Sequence, read from the Sequence itself. Kept as the reference that
test_sampling_metadata.py holds the tensor sampler to, token for token;
only its random draw changed, to the counter-based one, written here again
in plain Python integers so the two implementations check each other."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from shoal.workers.core.sequence import Sequence


@dataclass(slots=True)
class ReferenceResult:
    token_ids: list[int]
    # per row: None, or (sampled token's logprob, {token_id: logprob} of the top n)
    logprobs: list[tuple[float, dict[int, float]] | None]


class ReferenceSampler:
    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = list(eos_token_ids)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> ReferenceResult:
        """logits: [len(seqs), vocab] float32, one row per sequence."""
        raw = logits  # logprobs come from the unprocessed distribution
        for i, seq in enumerate(seqs):
            p = seq.params
            penalized = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
            banned = []
            if seq.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            if (penalized or banned) and logits is raw:
                logits = logits.clone()  # only when some row is changed: a step's logits are megabytes
            if penalized:
                self._apply_penalties(logits[i], seq)
            if banned:
                logits[i, banned] = float("-inf")

        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            probs = self._filtered_probs(logits[rows], [seqs[i].params for i in sampled_rows])
            for j, i in enumerate(sampled_rows):
                u = reference_uniform(seqs[i].sampling_seed, seqs[i].num_output_tokens)
                tokens[i] = inverse_cdf_token(probs[j], u)
        token_ids = tokens.tolist()

        logprobs: list = [None] * len(seqs)
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if want:
            lp = torch.log_softmax(raw[want], dim=-1)
            for j, i in enumerate(want):
                n = seqs[i].params.logprobs
                top = lp[j].topk(n) if n else None
                top_dict = dict(zip(top.indices.tolist(), top.values.tolist())) if top is not None else {}
                logprobs[i] = (lp[j, token_ids[i]].item(), top_dict)
        return ReferenceResult(token_ids, logprobs)

    @staticmethod
    def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
        p = seq.params
        if p.repetition_penalty != 1.0:
            # transformers' / vLLM's rule over prompt and output tokens.
            seen = torch.tensor(sorted(set(seq.token_ids)), device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            # OpenAI's rule, over generated tokens only.
            out = torch.tensor(seq.output_token_ids, device=row.device)
            counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
            row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
        logits = logits / temps
        top_ks = [p.top_k for p in params]
        top_ps = [p.top_p for p in params]
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            sorted_logits, idx = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[-1]
            ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device).unsqueeze(1)
            ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
            drop = ranks >= ks
            probs_sorted = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always the first).
            cum_before = probs_sorted.cumsum(dim=-1) - probs_sorted
            drop |= cum_before >= torch.tensor(top_ps, device=logits.device).unsqueeze(1)
            drop[:, 0] = False
            logits = logits.scatter(1, idx, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        min_ps = [p.min_p for p in params]
        if any(m > 0 for m in min_ps):
            m = torch.tensor(min_ps, device=logits.device).unsqueeze(1)
            probs = probs.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs


def reference_hash(seed: int, index: int) -> int:
    """The draw's 32-bit hash of (seed's low word, seed's high word, index),
    in Python integers: each word is folded in, offset by the golden ratio,
    then mixed by hash-prospector's low-bias mixer."""
    mask = (1 << 32) - 1
    h = 0
    for word in (seed & mask, (seed >> 32) & mask, index & mask):
        h = ((h ^ word) + 0x9E3779B9) & mask
        for shift, mul in ((16, 0x21F0AAAD), (15, 0x735A2D97), (15, None)):
            h ^= h >> shift
            if mul is not None:
                h = (h * mul) & mask
    return h


def reference_uniform(seed: int, index: int) -> float:
    """In (0, 1): the hash's top 24 bits, centred in their bin."""
    return ((reference_hash(seed, index) >> 8) + 0.5) / (1 << 24)


def inverse_cdf_token(probs: torch.Tensor, u: float) -> int:
    """One row: the first token whose cumulative mass exceeds u times the
    total, the target kept strictly below the total."""
    cdf = probs.cumsum(dim=0).tolist()
    total = np.float32(cdf[-1])
    target = min(np.float32(u * float(total)), np.nextafter(total, np.float32(0)))
    return bisect.bisect_right(cdf, float(target))

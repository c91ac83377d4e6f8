"""Turns one step's logits into tokens, each row by its own request's
settings in SamplingMetadata: penalties, min_tokens bans, temperature,
top-k/top-p/min-p, greedy or seeded sampling, and top-n logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.workers.model_executor.layers.sampling_metadata import SamplingMetadata


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]
    # per row: None, or (sampled token's logprob, {token_id: logprob} of the top n)
    logprobs: list[tuple[float, dict[int, float]] | None]


class Sampler:
    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [rows, vocab] float32, left unchanged."""
        raw = logits  # logprobs come from the unprocessed distribution
        if not metadata.no_penalties or metadata.banned_rows is not None:
            logits = logits.clone()  # only when some row is changed: a step's logits are megabytes
            self.apply_penalties(logits, metadata)
            if metadata.banned_rows is not None:
                logits[metadata.banned_rows, metadata.banned_token_ids] = float("-inf")

        tokens = logits.argmax(dim=-1)
        if not metadata.all_greedy:
            probs = self._probs(logits[metadata.random_rows], metadata)
            for j, i in enumerate(metadata.random_rows):
                # Exponential race: argmax(p / E), E ~ Exp(1) drawn from the
                # request's own generator, so a seed gives the same tokens
                # whatever else shares the batch.
                e = torch.empty_like(probs[j]).exponential_(generator=metadata.generators.get(i))
                tokens[i] = (probs[j] / e).argmax()
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, self._logprobs(raw, token_ids, metadata.num_logprobs))

    @staticmethod
    def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        """In place, on the penalized rows only."""
        if metadata.repetition_rows is not None:
            rows, penalty = metadata.repetition_rows, metadata.repetition_penalties.unsqueeze(1)
            x = logits[rows]
            # The bits of the Python-float division this replaced: CUDA does
            # that as a multiply by the reciprocal, the CPU as a division.
            shrunk = x * penalty.reciprocal() if x.is_cuda else x / penalty
            logits[rows] = torch.where(metadata.seen_mask, torch.where(x > 0, shrunk, x * penalty), x)
        if metadata.frequency_rows is not None:
            counts = metadata.output_token_counts.to(logits.dtype)
            present = (counts > 0).to(logits.dtype)
            logits[metadata.frequency_rows] -= (counts * metadata.frequency_penalties.unsqueeze(1)
                                                + present * metadata.presence_penalties.unsqueeze(1))  # fmt: skip

    @staticmethod
    def _probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The random rows' distributions after temperature and the filters."""
        logits = logits / metadata.temperature.unsqueeze(1)
        if metadata.top_k is not None:
            logits = _top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        if metadata.min_p is not None:
            floor = metadata.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs

    @staticmethod
    def _logprobs(raw: torch.Tensor, token_ids: list[int], num_logprobs: dict[int, int]) -> list:
        out: list = [None] * len(token_ids)
        if num_logprobs:
            lp = torch.log_softmax(raw[list(num_logprobs)], dim=-1)
            for j, (i, n) in enumerate(num_logprobs.items()):
                top = lp[j].topk(n)
                out[i] = (lp[j, token_ids[i]].item(), dict(zip(top.indices.tolist(), top.values.tolist())))
        return out


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k tokens, then the smallest prefix of them whose
    mass reaches top_p (always the first); the rest become -inf."""
    by_rank, order = logits.sort(dim=-1, descending=True)
    drop = torch.arange(logits.shape[-1], device=logits.device) >= top_k.unsqueeze(1)
    probs = by_rank.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    return logits.scatter(1, order, by_rank.masked_fill(drop, float("-inf")))

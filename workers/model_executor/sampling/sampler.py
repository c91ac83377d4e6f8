"""Turns one step's logits into tokens, each row by its own request's
settings in SamplingMetadata: penalties, min_tokens bans, temperature,
top-k/top-p/min-p, greedy or seeded sampling, and top-n logprobs. All on
whole-batch tensors, ending in one fetch of the step's results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shoal.workers.model_executor.sampling.metadata import SamplingMetadata
from shoal.workers.model_executor.sampling.noise import uniforms


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]
    # per row: None, or (sampled token's logprob, {token_id: logprob} of the top n)
    logprobs: list[tuple[float, dict[int, float]] | None]


class Sampler:
    cpu_kernels: Any = None  # the compiled CPU kernels, when the model runner binds them (argmax_rows)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [rows, vocab] float32, left unchanged."""
        raw = logits  # logprobs come from the unprocessed distribution
        if (
            not metadata.no_penalties
            or metadata.banned_rows is not None
            or metadata.bias_rows is not None
            or metadata.grammar_rows is not None
        ):
            logits = logits.clone()  # only when some row is changed: a step's logits are megabytes
            self.apply_penalties(logits, metadata)
            if metadata.bias_rows is not None:
                logits.index_put_((metadata.bias_rows, metadata.bias_token_ids), metadata.bias_values, accumulate=True)
            if metadata.grammar_rows is not None:
                apply_token_bitmask(logits, metadata.grammar_rows, metadata.grammar_bitmask)
            if metadata.banned_rows is not None:
                # A device tensor, not a Python float: that would be copied in from the host, a sync on CUDA.
                neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
                logits.index_put_((metadata.banned_rows, metadata.banned_token_ids), neg_inf)

        tokens = self._argmax(logits)
        if not metadata.all_greedy:
            rows = metadata.random_rows
            u = uniforms(metadata.seeds, metadata.output_index)
            tokens[rows] = sample_inverse_cdf(self._probs(logits[rows], metadata), u)
        if not metadata.num_logprobs:
            return SamplerOutput(tokens.tolist(), [None] * tokens.shape[0])
        return self._with_logprobs(raw, tokens, metadata)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax's indices; on the CPU through the compiled kernel (torch's
        took ~55 us a vocabulary row at one thread, about 1% of a decode step)."""
        k = self.cpu_kernels
        if k is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
            return k.argmax_rows(logits)
        return logits.argmax(dim=-1)

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
            logits[metadata.frequency_rows] -= counts * metadata.frequency_penalties.unsqueeze(
                1
            ) + present * metadata.presence_penalties.unsqueeze(1)

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
    def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """The tokens and the wanted rows' logprobs, in one fetch: token ids
        ride as float64 (exact below 2**53), float32 logprobs too."""
        rows, k = metadata.logprob_rows, min(metadata.max_num_logprobs, raw.shape[-1])
        lp = torch.log_softmax(raw[rows], dim=-1)  # from the unprocessed distribution
        parts = [tokens.double(), lp.gather(1, tokens[rows].unsqueeze(1)).double().flatten()]
        if k:
            top = lp.topk(k)  # the largest n asked for; each row keeps its first n below
            parts += [top.indices.double().flatten(), top.values.double().flatten()]
        flat = torch.cat(parts).tolist()
        num_rows, m = tokens.shape[0], len(metadata.num_logprobs)
        head = num_rows + m
        token_ids = [int(t) for t in flat[:num_rows]]
        sampled, top_ids, top_values = flat[num_rows:head], flat[head : head + m * k], flat[head + m * k :]
        out: list = [None] * num_rows
        for j, (i, n) in enumerate(metadata.num_logprobs.items()):
            n = min(n, k)
            ids = top_ids[j * k : j * k + n]
            out[i] = (sampled[j], dict(zip(map(int, ids), top_values[j * k : j * k + n])))
        return SamplerOutput(token_ids, out)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: each constrained row's disallowed tokens become -inf, in one
    masked fill over those rows; the other rows are untouched. The int32
    words are read as little-endian bytes (CPU and CUDA both), so bit k of
    byte b in word i is token 32i + 8b + k."""
    vocab, k = logits.shape[-1], bitmask.shape[0]
    bits = torch.tensor(_BIT_VALUES, dtype=torch.uint8, device=bitmask.device)
    banned = (bitmask.view(torch.uint8).unsqueeze(-1) & bits).view(k, -1)[:, :vocab] == 0
    if k == logits.shape[0]:  # every row constrained (rows ascend): in place, no gather and scatter
        logits.masked_fill_(banned, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill_(banned, float("-inf"))


_BIT_VALUES = (1, 2, 4, 8, 16, 32, 64, 128)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[rows] token ids: per row, the first token whose cumulative mass
    exceeds u * total. Never a zero-probability token: its cdf equals the
    one before it, so the search stops earlier."""
    cdf = probs.cumsum(dim=-1)
    if cdf.is_cuda:
        # A parallel scan may add in another order from token to token: make
        # zero-mass tokens repeat their predecessor and the cdf monotone, as
        # the CPU's sequential sum is by construction.
        cdf = torch.where(probs > 0, cdf, 0.0).cummax(dim=-1).values
    total = cdf[:, -1:]
    v = (u.unsqueeze(1) * total.double()).to(cdf.dtype)  # the product is exact in float64: one rounding
    v = torch.minimum(v, torch.nextafter(total, torch.zeros_like(total)))  # below the total, whatever u rounds to
    return torch.searchsorted(cdf, v, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)  # NaN rows stay in range


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

"""One step's sampling inputs as batch tensors, a row per sequence due a
token, so the sampler needs nothing from the engine's sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingMetadata:
    """Each step is given only the rows it changes; None (or empty) where no
    row needs it, so a greedy batch without penalties does no extra work."""

    # Rows with temperature > 0, on the device; their count on the host.
    random_rows: torch.Tensor | None
    num_random: int
    temperature: torch.Tensor | None  # [num_random]
    # [num_random] each, or None when no random row filters by top-k or top-p
    top_k: torch.Tensor | None  # the vocabulary size where off
    top_p: torch.Tensor | None  # 1.0 where off
    min_p: torch.Tensor | None  # [num_random], or None when no random row uses it
    # [num_random] int64 each: a row's token draws its uniform from (seed, output index) alone
    seeds: torch.Tensor | None  # the request's seed mod 2**64, as signed
    output_index: torch.Tensor | None  # the index among the request's output tokens of the one sampled now

    # transformers' / vLLM's repetition penalty, over prompt and output tokens
    repetition_rows: torch.Tensor | None
    repetition_penalties: torch.Tensor | None  # [len(repetition_rows)]
    seen_mask: torch.Tensor | None  # [len(repetition_rows), vocab]: in the prompt or output
    # OpenAI's presence and frequency penalties, over output tokens (rows with some)
    frequency_rows: torch.Tensor | None
    frequency_penalties: torch.Tensor | None  # [len(frequency_rows)]
    presence_penalties: torch.Tensor | None  # [len(frequency_rows)]
    output_token_counts: torch.Tensor | None  # [len(frequency_rows), vocab]

    # (row, token id) pairs set to -inf: stop tokens and eos before min_tokens
    banned_rows: torch.Tensor | None
    banned_token_ids: torch.Tensor | None

    # (row, token id, bias) triples added to the logits in one index_put_: OpenAI's logit_bias,
    # each request's ids and biases staged from the arrays it was checked into (LogitBias)
    bias_rows: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None

    # The constrained rows and their allowed tokens, packed (int32 words, bit j of word i: token 32i+j)
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None  # [len(grammar_rows), ceil(vocab / 32)] int32

    logprob_rows: torch.Tensor | None = None  # the rows of num_logprobs, in its order, on the device
    num_logprobs: dict[int, int] = field(default_factory=dict)  # row -> how many top logprobs (0: the sampled one's)

    @property
    def all_greedy(self) -> bool:
        return self.num_random == 0

    @property
    def max_num_logprobs(self) -> int:
        return max(self.num_logprobs.values(), default=0)

    @property
    def no_penalties(self) -> bool:
        return self.repetition_rows is None and self.frequency_rows is None

"""What one request may cost a router, counted once it is parsed (when its
prompts and `n` are known), by both fronts.

Sequences: a request is worth prompts x max(n, best_of) engine requests,
each of which holds a worker's batch slot and KV blocks as long as any
other; --max-concurrent-requests bounds their sum on this router. A
request that would pass it is 429 / RESOURCE_EXHAUSTED; one that could
never fit (more sequences than the whole limit) is 400 / INVALID_ARGUMENT
naming the field that multiplies it, as vLLM answers a request that can
never be served. Each stream claims its sequence when it starts and gives it
back when it ends, however it ends (Frontend.generate); the front gives back
those no stream claimed (it failed or was cancelled first).

Tokens: the request's prompt tokens (each prompt once: its samples share its
KV blocks) plus max_tokens for every sequence must fit
--max-tokens-per-request. A max_tokens the client chose that does not fit
is a 400 naming it; the default (chat: the rest of the context) shrinks
until the total fits, and a prompt that leaves no token for every sequence
is a 400 naming the prompt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shoal.proto.sampling_params import SamplingParams
from shoal.router.fronts.serving_error import ServingError


@dataclass(slots=True)
class Admitted:
    """The sequences one request holds. Each stream claims one as it starts
    and releases it as it ends; release_unclaimed gives back the rest."""

    admission: Admission
    unclaimed: int

    def claim(self) -> bool:
        """A stream starts (False: it holds none; nothing to release)."""
        if self.unclaimed <= 0:
            return False
        self.unclaimed -= 1
        return True

    def release(self) -> None:
        """A stream that claimed its sequence ended."""
        self.admission.in_flight -= 1

    def release_unclaimed(self) -> None:
        """The front is done starting streams: what none claimed goes back."""
        self.admission.in_flight -= self.unclaimed
        self.unclaimed = 0


class Admission:
    """One per router (Frontend.admission). max_sequences None: no cap."""

    def __init__(self, max_sequences: int | None, max_tokens_per_request: int):
        self.max_sequences = max_sequences
        self.max_tokens_per_request = max_tokens_per_request
        self.in_flight = 0  # sequences admitted and not yet ended

    def admit(self, num_sequences: int, field: str) -> Admitted:
        """Hold num_sequences for one request, or refuse it; `field` is what
        multiplies it (n, best_of or prompt), named in a 400."""
        limit = self.max_sequences
        if limit is not None:
            if num_sequences > limit:
                raise ServingError(
                    "invalid",
                    f"this request is {num_sequences} sequences (prompts x n or best_of); this router serves "
                    f"at most {limit} at once (--max-concurrent-requests)",
                    field,
                )
            if self.in_flight + num_sequences > limit:
                raise ServingError(
                    "full",
                    f"this router serves {limit} sequences at once (--max-concurrent-requests) and "
                    f"{self.in_flight} are running; this request needs {num_sequences}; try again later",
                    code="too_many_requests",
                )
        self.in_flight += num_sequences
        return Admitted(self, num_sequences)

    def fit_tokens(
        self, prepared: list[tuple[list[int], SamplingParams]], width: int, chosen: bool
    ) -> list[tuple[list[int], SamplingParams]]:
        """Each prompt's (ids, params) with max_tokens within the request's
        token budget; width: sequences per prompt; chosen: the client set
        max_tokens (else it is the default, which may shrink)."""
        budget = self.max_tokens_per_request
        num_prompt_tokens = sum(len(ids) for ids, _ in prepared)
        num_sequences = len(prepared) * width
        need = num_prompt_tokens + width * sum(p.max_tokens for _, p in prepared)
        if need <= budget:
            return prepared
        each = (budget - num_prompt_tokens) // num_sequences  # the most max_tokens every sequence can have
        if each < 1:
            raise ServingError(
                "invalid",
                f"the prompts' {num_prompt_tokens} tokens leave no room for {num_sequences} sequences' output "
                f"within --max-tokens-per-request ({budget})",
                "prompt",
            )
        if chosen:
            raise ServingError(
                "invalid",
                f"prompt tokens ({num_prompt_tokens}) + max_tokens ({prepared[0][1].max_tokens}) x {num_sequences} "
                f"sequences = {need} exceeds --max-tokens-per-request ({budget}); at most {each} fits",
                "max_tokens",
            )
        out = []
        for ids, p in prepared:
            if p.min_tokens > each:
                raise ServingError(
                    "invalid",
                    f"min_tokens ({p.min_tokens}) x {num_sequences} sequences does not fit "
                    f"--max-tokens-per-request ({budget}) beside the prompts' {num_prompt_tokens} tokens",
                    "min_tokens",
                )
            out.append((ids, dataclasses.replace(p, max_tokens=min(p.max_tokens, each))))
        return out


def sequences_field(num_prompts: int, n: int, best_of: int | None) -> str:
    """The field a 400 for too many sequences names."""
    if best_of is not None and best_of > 1:
        return "best_of"
    return "n" if n > 1 or num_prompts == 1 else "prompt"

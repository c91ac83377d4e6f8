"""Faults on purpose, for the tests of failure isolation: off unless the
worker's environment sets SHOAL_FAULT_INJECTION, which no deployment does.

SHOAL_FAULT_INJECTION="request=7,fatal=9": sampling a step that holds a
sequence whose prompt contains token id 7 raises, an error that is that
request's alone (the engine pins it on the request and goes on); a step
holding a prompt with token id 9 fails in a way no request can be blamed
for, as a kernel fault would, and the engine dies. "lora=NAME": filling a
LoRA slot with the adapter named NAME raises (its requests' failure alone).
Several faults may be given together."""

from __future__ import annotations

import os
from dataclasses import dataclass

from shoal.proto.errors import EngineFaultError

ENV = "SHOAL_FAULT_INJECTION"


class InjectedFault(RuntimeError):
    """A request's own failure, raised on purpose."""


@dataclass(frozen=True, slots=True)
class FaultPlan:
    request_token: int | None = None
    fatal_token: int | None = None
    lora_name: str | None = None

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        spec = os.environ.get(ENV, "").strip()
        if not spec:
            return None
        fields = {"request": "request_token", "fatal": "fatal_token", "lora": "lora_name"}
        kw = {}
        for part in spec.split(","):
            key, _, value = part.partition("=")
            if key.strip() not in fields:
                raise ValueError(f"{ENV}: unknown fault {key.strip()!r}; known: {', '.join(fields)}")
            kw[fields[key.strip()]] = value.strip() if key.strip() == "lora" else int(value)
        return cls(**kw)

    def before_sampling(self, seqs) -> None:
        """Raise as planned for the step's sequences due a token."""
        for seq in seqs:
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            if self.fatal_token is not None and self.fatal_token in prompt:
                raise EngineFaultError(f"injected fatal fault (prompt token {self.fatal_token})")
            if self.request_token is not None and self.request_token in prompt:
                raise InjectedFault(f"injected sampling fault (prompt token {self.request_token})")

    def before_slot_fill(self, lora_request) -> None:
        """Raise as planned when a LoRA slot is about to take this adapter."""
        if self.lora_name is not None and lora_request.lora_name == self.lora_name:
            raise InjectedFault(f"injected LoRA slot fault (adapter {self.lora_name!r})")

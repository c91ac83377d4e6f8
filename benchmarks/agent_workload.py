"""Agent traffic as the KV tiers see it: conversations whose every turn
resends the whole context so far (a shared system prompt, then each earlier
turn's user tokens and reply) and adds a few hundred tokens, for a short
reply. Conversations interleave, turn by turn, so a conversation's context
has usually left the paged cache by the time it comes back.

Token ids are drawn at random (seeded) from the model's vocabulary; a
reply's ids are whatever the engine generated, so each turn's prompt holds
the previous turn's prompt and reply, as a chat client's would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class AgentWorkload:
    conversations: int = 8
    turns: tuple[int, int] = (6, 10)  # turns per conversation, drawn in this range
    system_len: int = 2000
    turn_len: tuple[int, int] = (200, 600)  # tokens each turn adds
    output_len: tuple[int, int] = (16, 64)
    seed: int = 0


@dataclass(slots=True)
class Conversation:
    """One conversation's context so far, and its turns still to come
    (each: the new user tokens and the reply's length)."""

    context: list[int]
    turns: list[tuple[list[int], int]] = field(default_factory=list)
    reused: int = 0  # tokens of the next prompt a cache could hold: what the last turn sent and got back


def make_conversations(w: AgentWorkload, vocab_size: int) -> list[Conversation]:
    rng = random.Random(w.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    system = tokens(w.system_len)
    out = []
    for _ in range(w.conversations):
        n_turns = rng.randint(*w.turns)
        turns = [(tokens(rng.randint(*w.turn_len)), rng.randint(*w.output_len)) for _ in range(n_turns)]
        out.append(Conversation(list(system), turns, reused=len(system)))
    return out


def interleaved(conversations: list[Conversation]):
    """(conversation, turn index) in the order they are sent: every
    conversation's first turn, then every second turn, and so on."""
    longest = max(len(c.turns) for c in conversations)
    for t in range(longest):
        for c in conversations:
            if t < len(c.turns):
                yield c, t


def shuffled(conversations: list[Conversation], seed: int):
    """(conversation, turn index): each conversation's turns in order, the
    next turn from a conversation drawn at random (seeded) among those with
    turns left, as agents that do not take turns in step send them. (Taken
    in turn, 2k conversations over 2 workers routed round-robin would keep
    every conversation on one worker.)"""
    rng = random.Random(seed)
    left = [[c, 0] for c in conversations]
    while left:
        i = rng.randrange(len(left))
        c, t = left[i]
        yield c, t
        left[i][1] += 1
        if left[i][1] == len(c.turns):
            left.pop(i)


def unique_prompts(w: AgentWorkload, vocab_size: int, n: int) -> list[tuple[list[int], int]]:
    """n requests of a first turn's size (system prompt and a turn) sharing
    nothing, not even the system prompt: (ids, max_tokens)."""
    rng = random.Random(w.seed + 1)
    return [
        (
            [rng.randrange(3, vocab_size) for _ in range(w.system_len + rng.randint(*w.turn_len))],
            rng.randint(*w.output_len),
        )
        for _ in range(n)
    ]

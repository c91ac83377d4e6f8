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

import hashlib
import random
import statistics
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


def summarize(rows: list[dict], convs: list[Conversation], seconds: float, moved: int) -> dict:
    """A conversation run's figures from its rows (turn, prompt, ideal, ttft_s,
    cached: one a request) and the conversations as they ended."""
    later = [r["ttft_s"] for r in rows if r["turn"] > 0]
    ideal = sum(r["ideal"] for r in rows)
    output_tokens = sum(r for c in convs for _, r in c.turns)
    return {
        "seconds": seconds,
        "requests": len(rows),
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / seconds,
        "prompt_tokens": sum(r["prompt"] for r in rows),
        "hit_tokens": sum(r["cached"] for r in rows),
        "ideal_tokens": ideal,
        "hit_share_of_ideal": sum(min(r["cached"], r["ideal"]) for r in rows) / ideal if ideal else 0.0,
        "ttft_p50_later_turns_s": statistics.median(later) if later else 0.0,
        "moved_turn_share": moved / max(1, sum(r["turn"] > 0 for r in rows)),  # on another engine than the last
        # of every conversation's context at the end: the same with tiers on and off
        "replies_sha256": hashlib.sha256(repr([c.context for c in convs]).encode()).hexdigest()[:16],
    }

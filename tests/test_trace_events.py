"""The worker span's events come from the engine's own record of a request:
a real preemption (a cache too small for the batch) leaves its times on
RequestTimings, and the span gets scheduled, preempted, resumed and
first_token at those times, in order."""

from __future__ import annotations

import random

from shoal.proto.messages import GenerateRequest, RequestFinished
from shoal.proto.tracing import finish_worker_span
from shoal.workers import LLMEngine, SamplingParams


class RecordingSpan:
    """Stands in for an SDK span: records what the worker's helpers do to it."""

    def __init__(self):
        self.events, self.attributes, self.ended_at = [], {}, None

    def is_recording(self) -> bool:
        return self.ended_at is None

    def add_event(self, name, attributes=None, timestamp=None):
        self.events.append((name, timestamp))

    def set_attributes(self, attributes):
        self.attributes.update(attributes)

    def set_attribute(self, key, value):
        self.attributes[key] = value

    def end(self, end_time=None):
        self.ended_at = end_time


def test_preempted_and_resumed_times_become_the_worker_spans_events(tiny_model):
    eng = LLMEngine(model=tiny_model, num_kv_blocks=40)  # 16 prompts up to 600 tokens: some are preempted
    rng = random.Random(1)
    lengths = [1, 2, 5, 17, 31, 64, 100, 150, 200, 256, 300, 350, 420, 480, 550, 600]
    rng.shuffle(lengths)
    for i, n in enumerate(lengths):
        eng.add_request(
            GenerateRequest(
                f"r{i}",
                [rng.randrange(eng.model_config.vocab_size) for _ in range(n)],
                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            )
        )
    last = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            last[out.request_id] = out
    assert eng.stats().num_preemptions > 0
    preempted = [o for o in last.values() if o.timings.preempted]
    assert preempted and all(len(o.timings.resumed) == len(o.timings.preempted) for o in last.values())
    for o in preempted:
        t = o.timings
        # Each preemption is followed by its return to the batch, before the request ends.
        for p, r in zip(t.preempted, t.resumed):
            assert t.first_scheduled <= p <= r <= t.finished
        span = RecordingSpan()
        finish_worker_span(
            span,
            t,
            RequestFinished(
                o.finish_reason,
                None,
                "w",
                o.num_prompt_tokens,
                o.num_cached_tokens,
                o.num_output_tokens,
                t.first_scheduled - t.arrival,
            ),
        )
        names = [n for n, _ in span.events]
        times = [ts for _, ts in span.events]
        assert times == sorted(times)  # in the order they happened
        assert names.count("preempted") == len(t.preempted) == names.count("resumed")
        assert names[0] == "scheduled" and "first_token" in names
        assert span.ended_at == int(t.finished * 1e9) and span.attributes["gen_ai.usage.output_tokens"] == 24

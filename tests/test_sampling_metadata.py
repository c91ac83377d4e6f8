"""The sampler on SamplingMetadata tensors against the per-sequence one it
replaced (reference_sampler.py): the same tokens and logprobs, bit for bit,
over random batches that mix every kind of row."""

from __future__ import annotations

import random

import torch

from reference_sampler import ReferenceSampler
from shoal.workers.core.sampling_params import SamplingParams
from shoal.workers.core.sequence import RequestTimings, Sequence
from shoal.workers.model_executor.layers.sampler import Sampler
from shoal.workers.model_executor.sampling_metadata_builder import build_sampling_metadata

VOCAB = 48
EOS = [2, 7]
CPU = torch.device("cpu")


def random_seq(rng: random.Random) -> Sequence:
    num_output = rng.choice([0, 0, 1, 3, 12])
    max_tokens = num_output + rng.randint(1, 8)
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=rng.randint(0, max_tokens),  # above num_output: stop ids and eos are banned
        temperature=rng.choice([0.0, 0.0, 0.3, 1.0, 1.8]),
        top_k=rng.choice([-1, -1, 1, 5, 80]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.3]),
        min_p=rng.choice([0.0, 0.0, 0.1, 0.6]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.4, 0.7]),
        presence_penalty=rng.choice([0.0, 0.0, 0.8, -1.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.4, -0.6]),
        stop_token_ids=rng.choice([[], [], [3], [7, 11]]),
        ignore_eos=rng.random() < 0.3,
        logprobs=rng.choice([None, None, 0, 1, 5]),
    )
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
    output = [rng.randrange(VOCAB) for _ in range(num_output)]
    return Sequence("r", prompt + output, len(prompt), params, 0, 0, RequestTimings(0.0))


def give_generators(seqs: list[Sequence], seeds: list[int | None]) -> None:
    """A fresh generator per seed; None leaves the row on torch's default one."""
    for seq, seed in zip(seqs, seeds):
        seq.generator = None if seed is None else torch.Generator().manual_seed(seed)


def test_tensor_sampler_equals_the_per_sequence_one():
    rng = random.Random(0)
    reference, sampler = ReferenceSampler(EOS), Sampler()
    for batch in range(300):
        seqs = [random_seq(rng) for _ in range(rng.randint(1, 10))]
        seeds = [None if s.params.greedy or rng.random() < 0.2 else rng.getrandbits(32) for s in seqs]
        logits = 3 * torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(batch))
        if batch % 4 == 0:
            logits = logits.round()  # ties
        before = logits.clone()

        give_generators(seqs, seeds)
        torch.manual_seed(batch)
        want = reference(logits, seqs)
        give_generators(seqs, seeds)
        torch.manual_seed(batch)
        metadata = build_sampling_metadata(seqs, EOS, VOCAB, CPU)
        got = sampler(logits, metadata)

        assert got.sampled_token_ids == want.token_ids, f"batch {batch}"
        assert got.logprobs == want.logprobs, f"batch {batch}"
        assert torch.equal(logits, before)  # the step's logits stay as the model made them
        # A last-bit change in a penalized logit rarely moves a token: the
        # penalized logits themselves must match too.
        penalized, want_penalized = logits.clone(), logits.clone()
        Sampler.apply_penalties(penalized, metadata)
        for i, seq in enumerate(seqs):
            ReferenceSampler._apply_penalties(want_penalized[i], seq)
        assert torch.equal(penalized, want_penalized), f"batch {batch}"


def test_a_plain_greedy_batch_asks_for_no_extra_work():
    rng = random.Random(1)
    seqs = [Sequence("r", [rng.randrange(VOCAB) for _ in range(9)], 5, SamplingParams(temperature=0), 0, 0,
                     RequestTimings(0.0)) for _ in range(4)]  # fmt: skip
    metadata = build_sampling_metadata(seqs, EOS, VOCAB, CPU)
    assert metadata.all_greedy and metadata.no_penalties
    assert metadata.banned_rows is None and not metadata.num_logprobs

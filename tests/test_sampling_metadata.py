"""The sampler on SamplingMetadata tensors against the per-sequence one it
replaced (reference_sampler.py): the same tokens and logprobs, bit for bit,
over random batches that mix every kind of row, seeds included; a seeded
row's token whatever shares its batch; the staged form of the metadata."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from reference_sampler import ReferenceSampler

from shoal.proto.sampling_params import SamplingParams
from shoal.workers.core.sequence import RequestTimings, Sequence
from shoal.workers.model_executor.runner.staging_buffer import StagingBuffer
from shoal.workers.model_executor.sampling.builder import build_sampling_metadata, stage_sampling_metadata
from shoal.workers.model_executor.sampling.sampler import Sampler

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


def test_tensor_sampler_equals_the_per_sequence_one():
    rng = random.Random(0)
    reference, sampler = ReferenceSampler(EOS), Sampler()
    for batch in range(300):
        seqs = [random_seq(rng) for _ in range(rng.randint(1, 10))]
        for seq in seqs:  # the engine's 63-bit draws, and the edges any int seed may take
            seq.sampling_seed = rng.choice([rng.getrandbits(63), rng.getrandbits(32), 0, 2**63 - 1, 2**64 - 1, -5])
        logits = 3 * torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(batch))
        if batch % 4 == 0:
            logits = logits.round()  # ties
        before = logits.clone()

        want = reference(logits, seqs)
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


def sample(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    return Sampler()(logits, build_sampling_metadata(seqs, EOS, VOCAB, CPU)).sampled_token_ids


def test_a_seed_and_index_give_one_token_whatever_the_batch_holds():
    rng = random.Random(2)
    seeds = [rng.getrandbits(63) for _ in range(6)] + [5, 5]  # two requests on one seed
    seqs = [
        Sequence("r", [1] * (3 + i), 3, SamplingParams(temperature=1.0, top_p=0.95), 0, 0, RequestTimings(0.0))
        for i in range(8)
    ]
    for seq, seed in zip(seqs, seeds):
        seq.sampling_seed = seed
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(2))
    alone = [sample([seq], logits[i : i + 1])[0] for i, seq in enumerate(seqs)]
    assert len(set(alone)) > 2  # really sampled: not one argmax for all

    others = [random_seq(rng) for _ in range(12)]
    for j, seq in enumerate(others):
        seq.sampling_seed = j
    order = list(range(len(seqs) + len(others)))
    rng.shuffle(order)
    everyone = seqs + others
    mixed_logits = torch.cat([logits, 3 * torch.randn(len(others), VOCAB)])
    batched = sample([everyone[k] for k in order], mixed_logits[order])
    assert [batched[order.index(i)] for i in range(len(seqs))] == alone


def test_staged_with_the_step_inputs_it_resolves_as_built_alone():
    rng = random.Random(3)
    seqs = [random_seq(rng) for _ in range(16)]
    for seq in seqs:
        seq.sampling_seed = rng.getrandbits(63)
    logits = 3 * torch.randn(len(seqs), VOCAB)
    batch = StagingBuffer(CPU).begin()
    batch.add("input_ids", [5, 6, 7], torch.int64)  # the step's own inputs share the batch
    pending = stage_sampling_metadata(seqs, EOS, VOCAB, batch)
    tensors = batch.upload()
    staged = set(tensors) - {"input_ids"}
    assert staged and all(name.startswith("sampling.") for name in staged)
    got = Sampler()(logits, pending.resolve(tensors, CPU))
    want = Sampler()(logits, build_sampling_metadata(seqs, EOS, VOCAB, CPU))
    assert (got.sampled_token_ids, got.logprobs) == (want.sampled_token_ids, want.logprobs)


def test_a_plain_greedy_batch_asks_for_no_extra_work():
    rng = random.Random(1)
    seqs = [
        Sequence(
            "r", [rng.randrange(VOCAB) for _ in range(9)], 5, SamplingParams(temperature=0), 0, 0, RequestTimings(0.0)
        )
        for _ in range(4)
    ]
    batch = StagingBuffer(CPU).begin()
    stage_sampling_metadata(seqs, EOS, VOCAB, batch)
    assert batch.upload() == {}  # nothing staged, nothing to copy
    metadata = build_sampling_metadata(seqs, EOS, VOCAB, CPU)
    assert metadata.all_greedy and metadata.no_penalties
    assert metadata.banned_rows is None and not metadata.num_logprobs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_step_syncs_once_for_its_results():
    rng, cuda = random.Random(4), torch.device("cuda")
    seqs = [random_seq(rng) for _ in range(64)]  # every kind of row
    for seq in seqs:
        seq.sampling_seed = rng.getrandbits(63)
    logits = 3 * torch.randn(len(seqs), VOCAB, device=cuda)
    staging, sampler = StagingBuffer(cuda), Sampler()
    for check in (False, True):  # the first round warms allocators up
        batch = staging.begin()
        pending = stage_sampling_metadata(seqs, EOS, VOCAB, batch)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn" if check else "default")
            try:
                out = sampler(logits, pending.resolve(batch.upload(), cuda))
            finally:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchronizing" in str(w.message)]
    assert len(syncs) == 1, "\n".join(syncs)  # the one fetch
    assert len(out.sampled_token_ids) == len(seqs)

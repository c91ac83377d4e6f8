"""The counter-based draw: the tensor hash against the plain-Python one in
reference_sampler.py, the uniform's range, and inverse-CDF sampling's
support and frequencies."""

from __future__ import annotations

import random

import pytest
import torch
from reference_sampler import inverse_cdf_token, reference_hash, reference_uniform

from shoal.workers.model_executor.sampling.noise import as_int64_seed, hash32, uniforms
from shoal.workers.model_executor.sampling.sampler import sample_inverse_cdf

EDGE_SEEDS = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63), 2**70 + 3]
EDGE_INDICES = [0, 1, 2, 255, 2**31, 2**32 - 1]
U_MIN, U_MAX = 0.5 / 2**24, 1 - 0.5 / 2**24  # the uniform's extremes


def draw(seeds: list[int], indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.tensor([as_int64_seed(x) for x in seeds])
    i = torch.tensor(indices)
    return hash32(s, i), uniforms(s, i)


def test_the_hash_equals_the_plain_python_one():
    rng = random.Random(0)
    pairs = [(s, i) for s in EDGE_SEEDS for i in EDGE_INDICES]
    pairs += [(rng.getrandbits(64), rng.randrange(100_000)) for _ in range(2000)]
    h, u = draw([s for s, _ in pairs], [i for _, i in pairs])
    assert h.tolist() == [reference_hash(s, i) for s, i in pairs]
    assert u.tolist() == [reference_uniform(s, i) for s, i in pairs]
    assert reference_hash(0, 0) != 0  # the golden-ratio offset: zero does not hash to zero


def test_the_uniform_is_strictly_inside_0_1_and_spread():
    n = 1 << 16
    _, u = draw([0] * n, list(range(n)))  # one stream: a request's consecutive tokens
    assert 0 < u.min().item() and u.max().item() < 1
    assert U_MIN <= u.min().item() and u.max().item() <= U_MAX
    assert abs(u.mean().item() - 0.5) < 0.01
    counts = torch.histc(u.float(), bins=16, min=0, max=1)  # expect 4096 each
    assert ((counts - n / 16).abs() < 400).all(), counts


def test_a_zero_probability_token_is_never_sampled():
    rows = torch.tensor(
        [
            [0.0, 0.5, 0.0, 0.5, 0.0],
            [0.0, 0.0, 0.0, 0.0, 1.0],
            [1.0, 0.0, 0.0, 0.0, 0.0],
            [1e-30, 0.0, 1.0, 0.0, 1e-30],
            [0.3, 0.0, 0.0, 0.7 - 1e-8, 0.0],
        ]
    )
    # the uniform's extremes, and 0 and 1 beyond them
    for u in (U_MIN, U_MAX, 0.0, 1.0, 0.5):
        got = sample_inverse_cdf(rows, torch.full((rows.shape[0],), u, dtype=torch.float64))
        assert (rows[torch.arange(rows.shape[0]), got] > 0).all(), (u, got)
        assert got.tolist() == [inverse_cdf_token(r, u) for r in rows]
    assert sample_inverse_cdf(rows[:1], torch.tensor([U_MIN], dtype=torch.float64)).item() == 1
    assert sample_inverse_cdf(rows[:1], torch.tensor([U_MAX], dtype=torch.float64)).item() == 3


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    keep = probs > 0
    return (((counts - expected)[keep] ** 2) / expected[keep]).sum().item()


def test_sampled_frequencies_match_the_distribution():
    # df = 5; chi-square above 30 has p < 2e-5. The draws are fixed by their
    # (seed, index), so this never flakes; a wrong mapping (u squared,
    # a shifted token) lands in the thousands.
    probs = torch.tensor([0.3, 0.0, 0.2, 0.15, 0.15, 0.0, 0.1, 0.1])
    n = 40_000
    seeds = torch.arange(n)  # many requests' first tokens, seeds 0, 1, 2, ...
    stream = torch.full((n,), 1234)  # one request's n tokens
    for s, i in ((seeds, torch.zeros(n, dtype=torch.long)), (stream, torch.arange(n))):
        tokens = sample_inverse_cdf(probs.expand(n, -1), uniforms(s, i))
        assert not probs[tokens].eq(0).any()
        assert chi_square(tokens, probs) < 30
    skewed = sample_inverse_cdf(probs.expand(n, -1), uniforms(stream, torch.arange(n)) ** 2)
    assert chi_square(skewed, probs) > 1000  # the check can tell a wrong mapping


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_same_draws_and_never_a_zero_probability_token():
    cuda, gen = torch.device("cuda"), torch.Generator().manual_seed(5)
    seeds = torch.randint(-(2**62), 2**62, (4096,), generator=gen)
    index = torch.randint(0, 2**20, (4096,), generator=gen)
    assert torch.equal(uniforms(seeds.to(cuda), index.to(cuda)).cpu(), uniforms(seeds, index))
    # a big vocabulary, most of it cut (as top-k / min-p leave it), u anywhere and at its extremes
    probs = torch.randn(512, 150_000, generator=gen).softmax(dim=-1)
    probs = probs.masked_fill(torch.rand(probs.shape, generator=gen) < 0.95, 0.0).to(cuda)
    for u in (uniforms(seeds[:512], index[:512]), torch.full((512,), U_MIN), torch.full((512,), U_MAX)):
        tokens = sample_inverse_cdf(probs, u.double().to(cuda))
        assert (probs[torch.arange(512, device=cuda), tokens] > 0).all()

"""Layer-level checks against transformers and against hand computation."""

from __future__ import annotations

import pytest
import torch

from shoal.proto.sampling_params import SamplingParams
from shoal.workers.core.sequence import RequestTimings, Sequence
from shoal.workers.model_executor.layers.rotary import rope_inv_freq
from shoal.workers.model_executor.sampling.builder import build_sampling_metadata
from shoal.workers.model_executor.sampling.sampler import Sampler


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2},
    ],
)
def test_rope_scaling_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = (
        {"rope_type": "default", "rope_theta": 500000.0} if scaling is None else {**scaling, "rope_theta": 500000.0}
    )
    cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=params)
    if scaling is None:
        ref = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    ours, scale = rope_inv_freq(128, 500000.0, scaling)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def _seq(prompt, output, **params):
    s = Sequence("r", prompt + output, len(prompt), SamplingParams(**params), 0, 0, RequestTimings(0.0))
    return s


def _metadata(seq, eos_token_ids=()):
    return build_sampling_metadata([seq], list(eos_token_ids), 5, torch.device("cpu"))


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    # tokens 0 and 1 in the prompt, 3 twice and 2 once in the output
    seq = _seq([0, 1], [3, 3, 2], temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    penalized = logits.clone()
    Sampler.apply_penalties(penalized, _metadata(seq))
    row = penalized[0]
    # repetition (all seen tokens): positive / 2, negative * 2
    expected = torch.tensor([1.0, -2.0, 0.25, 1.5, 1.0])
    # presence and frequency (output tokens only)
    expected[3] -= 0.5 + 2 * 0.25
    expected[2] -= 0.5 + 1 * 0.25
    torch.testing.assert_close(row, expected)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    sampler = Sampler()
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0, 10.0]])  # eos (4) best, stop id 2 next
    early = _seq([1], [0], temperature=0, min_tokens=3, stop_token_ids=[2])
    assert sampler(logits, _metadata(early, [4])).sampled_token_ids == [0]  # 4 and 2 banned, first of the ties
    late = _seq([1], [0, 0, 0], temperature=0, min_tokens=3, stop_token_ids=[2])
    assert sampler(logits, _metadata(late, [4])).sampled_token_ids == [4]

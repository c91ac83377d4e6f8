"""Per-tensor KV cache scales stored in a checkpoint (llm-compressor's
kv_cache_scheme: `self_attn.k_scale` / `v_scale`, or the older
`k_proj.output_scale` / `v_proj.output_scale` names vLLM also reads) are
loaded into each attention layer (layers/attention/kv_cache.py) and used
by --kv-cache-dtype fp8, which stores k / k_scale; another cache ignores
them. A scale that is not one positive finite number, and a scheme other
than static fp8 per tensor, are refused at start.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from ct_checkpoints import write_checkpoints
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from shoal.workers import LLM, SamplingParams

ENGINE = dict(num_threads=1, num_kv_blocks=64)
PROMPTS = [[5, 17, 99, 3, 250], [7, 7, 300, 41]]
SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> str:
    """An fp8 compressed-tensors checkpoint without KV scales."""
    root = tmp_path_factory.mktemp("kv-scales")
    base = make_tiny_model(str(root / "base"), hidden_size=128, intermediate_size=256)
    write_checkpoints(base, str(root / "q"), str(root / "e"), "fp8_tensor")
    return str(root / "q")


def _with_scales(src: str, dst: str, scales: dict[str, torch.Tensor], scheme=SCHEME) -> str:
    shutil.copytree(src, dst)
    weights = load_file(os.path.join(dst, "model.safetensors"))
    save_file({**weights, **scales}, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"]["kv_cache_scheme"] = scheme
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def _scales() -> tuple[dict[str, torch.Tensor], list[tuple[float, float]]]:
    """Layer 0 under llm-compressor's names, layer 1 under the older ones."""
    want = [(0.0173, 0.0291), (0.0442, 0.0087)]
    t = {
        "model.layers.0.self_attn.k_scale": torch.tensor(want[0][0]),
        "model.layers.0.self_attn.v_scale": torch.tensor(want[0][1]),
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([want[1][0]]),
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([want[1][1]]),
    }
    return t, [(float(torch.tensor(k)), float(torch.tensor(v))) for k, v in want]


def _logprobs(llm: LLM) -> list:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))
    return [(o.token_ids, [lp.top_logprobs for lp in o.logprobs]) for o in outs]


def _layers(llm: LLM):
    return [layer.self_attn.attn for layer in llm.engine.runner.model.layers]


def test_stored_scales_are_read_and_an_fp8_cache_uses_them(plain, tmp_path):
    tensors, want = _scales()
    path = _with_scales(plain, str(tmp_path / "scaled"), tensors)
    with LLM(path, kv_cache_dtype="fp8", **ENGINE) as llm:
        assert [(a.k_scale, a.v_scale) for a in _layers(llm)] == want
        got = _logprobs(llm)
        cache = _layers(llm)[0].k_cache
        assert cache.dtype == torch.float8_e4m3fn
    # The same weights with the scales set by hand: the same run, so the
    # loaded scales are what the cache writes and reads divide and multiply by.
    with LLM(plain, kv_cache_dtype="fp8", **ENGINE) as llm:
        assert [(a.k_scale, a.v_scale) for a in _layers(llm)] == [(1.0, 1.0)] * 2
        for a, (k, v) in zip(_layers(llm), want):
            a.k_scale, a.v_scale = k, v
        assert _logprobs(llm) == got
        for a in _layers(llm):  # tiny scales: most keys saturate at +-448 * scale, a different run
            a.k_scale = a.v_scale = 1e-4
        assert _logprobs(llm) != got


def test_a_float_cache_ignores_stored_scales(plain, tmp_path):
    tensors, want = _scales()
    path = _with_scales(plain, str(tmp_path / "scaled"), tensors)
    with LLM(path, **ENGINE) as llm:
        assert [(a.k_scale, a.v_scale) for a in _layers(llm)] == want
        got = _logprobs(llm)
    with LLM(plain, **ENGINE) as llm:
        assert _logprobs(llm) == got


def test_the_legacy_kv_scale_sets_both(plain, tmp_path):
    path = _with_scales(plain, str(tmp_path / "kv"), {"model.layers.1.self_attn.kv_scale": torch.tensor(0.03)})
    with LLM(path, kv_cache_dtype="fp8", **ENGINE) as llm:
        a0, a1 = _layers(llm)
        assert (a0.k_scale, a0.v_scale) == (1.0, 1.0)
        assert a1.k_scale == a1.v_scale == float(torch.tensor(0.03))


@pytest.mark.parametrize(
    "value",
    [torch.tensor(-0.5), torch.tensor(0.0), torch.tensor(float("nan")), torch.tensor(float("inf")), torch.ones(2)],
)
def test_a_scale_that_is_not_one_positive_number_is_refused(plain, tmp_path, value):
    path = _with_scales(plain, str(tmp_path / "bad"), {"model.layers.0.self_attn.k_scale": value})
    with pytest.raises(ValueError, match="layers.0.self_attn.k_scale: a KV cache scale must be one positive finite"):
        LLM(path, kv_cache_dtype="fp8", **ENGINE)


def test_a_scale_for_a_layer_the_model_lacks_is_refused(plain, tmp_path):
    path = _with_scales(plain, str(tmp_path / "extra"), {"model.layers.9.self_attn.v_scale": torch.tensor(0.1)})
    with pytest.raises(ValueError, match="layers.9.self_attn.v_scale.* has no place in the model"):
        LLM(path, kv_cache_dtype="fp8", **ENGINE)


@pytest.mark.parametrize(
    "edit,match",
    [
        (dict(type="int"), "type='int'"),
        (dict(type=None), "type=None"),
        (dict(num_bits=4), "num_bits=4"),
        (dict(strategy="head"), "strategy='head'"),
        (dict(dynamic=True), "dynamic=True"),
        (dict(symmetric=False), "symmetric=False"),
    ],
)
def test_a_kv_cache_scheme_other_than_static_fp8_per_tensor_is_refused(plain, tmp_path, edit, match):
    scheme = {k: v for k, v in {**SCHEME, **edit}.items() if v is not None}
    path = _with_scales(plain, str(tmp_path / "bad"), {}, scheme)
    with pytest.raises(ValueError, match=f"kv_cache_scheme {match} is not served"):
        LLM(path, **ENGINE)

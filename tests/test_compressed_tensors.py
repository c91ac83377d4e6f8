"""Compressed-tensors checkpoints (llm-compressor's) load as stored and
compute what their weights say (layers/quantization/compressed_tensors.py).

Each checkpoint is written in the test from a tiny float model
(ct_checkpoints.py), beside a float checkpoint of the same weights expanded
(q * scale). Every linear layer is loaded into its place and computes
x W^T of the expanded W within the bound its activations' quantization
implies (none for W4A16, 8-bit per token for int8, e4m3 per token for
fp8); end to end, given the same prefixes, the greedy tokens and their log
probabilities follow the expanded model's.
A checkpoint shoal does not serve, and a --quantization that contradicts
the checkpoint, are refused at start with the reason.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from ct_checkpoints import write_checkpoints
from tiny_models import make_tiny_model

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.layers.quantization.compressed_tensors import (
    CompressedTensorsConfig,
    CTFp8Method,
    CTInt8Method,
    CTW4A16Method,
)

ENGINE = dict(num_threads=1, num_kv_blocks=64)
PROMPTS = ["the quick brown fox", "hello world, this is", "a b c d e f", "numbers 1 2 3"]
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
# End to end, given the same prefixes, on this tiny random model (whose logits are spread wide, so every
# error shows): the greedy token agrees at least this often, and the mean difference of its log
# probability is at most this. Measured: W4A16 48/48 and 6e-7; int8 43/48 and 0.094; fp8 35-37/48, 0.36-0.41.
AGREEMENT = {"w4a16": 1.0, "int8_channel": 0.8, "fp8_channel": 0.65, "fp8_tensor": 0.65}
MEAN_LOGPROB = {"w4a16": 1e-4, "int8_channel": 0.2, "fp8_channel": 0.7, "fp8_tensor": 0.7}


def activation_bound(scheme: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The largest |x W^T - y| the activations' quantization allows, [M, N]:
    int8 rounds each x to within max|x_row| / 254; e4m3 to within 2^-4 of
    itself, or 2^-10 of the row's scale (max|x_row| / 448) below its normals;
    W4A16 keeps x (float32 rounding only)."""
    amax = x.abs().amax(dim=1, keepdim=True)
    if scheme == "w4a16":
        dx = 1e-6 * x.abs() + 1e-7 * amax
    elif scheme == "int8_channel":
        dx = (amax / 254).expand_as(x)
    else:
        dx = 2.0**-4 * x.abs() + 2.0**-10 * amax / 448
    return dx @ w.abs().T * 1.0001 + 1e-6


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    # 128 and 256 input features: whole groups of 128 for W4A16
    return make_tiny_model(str(tmp_path_factory.mktemp("ct-base")), hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def checkpoints(base, tmp_path_factory):
    made = {}

    def make(scheme: str) -> tuple[str, str]:
        if scheme not in made:
            root = tmp_path_factory.mktemp(f"ct-{scheme}")
            q, e = str(root / "quantized"), str(root / "expanded")
            write_checkpoints(base, q, e, scheme)
            made[scheme] = (q, e)
        return made[scheme]

    return make


def forced_top_logprobs(llm: LLM, asks: list[list[int]]) -> list[dict[int, float]]:
    outs = llm.generate(asks, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    return [o.logprobs[0].top_logprobs for o in outs]


@pytest.mark.parametrize(
    "scheme,method",
    [
        ("w4a16", CTW4A16Method),
        ("int8_channel", CTInt8Method),
        ("fp8_channel", CTFp8Method),
        ("fp8_tensor", CTFp8Method),
    ],
)
def test_a_checkpoint_computes_what_its_expanded_weights_do(checkpoints, scheme, method):
    quantized, expanded = checkpoints(scheme)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(expanded, **ENGINE) as ref:
        model = ref.engine.model_executor.driver_worker.runner.model
        weights = {(i, n): model.layers[i].get_submodule(n).weight.clone() for i in range(2) for n in LINEARS}
        ids = [ref.tokenizer.encode(p) for p in PROMPTS]
        cont = [o.token_ids for o in ref.generate(ids, sp)]
        asks = [p + c[:i] for p, c in zip(ids, cont) for i in range(len(c))]
        want = forced_top_logprobs(ref, asks)
    with LLM(quantized, **ENGINE) as q:
        model = q.engine.model_executor.driver_worker.runner.model
        gen = torch.Generator().manual_seed(0)
        for i in range(2):
            for name in LINEARS:  # every layer: loaded into its place, within its activations' bound
                layer = model.layers[i].get_submodule(name)
                assert isinstance(layer.quant_method, method)
                stored = layer.weight_packed if scheme == "w4a16" else layer.weight
                assert stored.dtype == {"w4a16": torch.int32, "int8_channel": torch.int8}.get(
                    scheme, torch.float8_e4m3fn
                )
                w = weights[i, name]
                x = torch.randn(5, w.shape[1], generator=gen) * 3
                err = (layer(x) - x @ w.T).abs()
                assert (err <= activation_bound(scheme, x, w)).all(), f"layer {i} {name}: {err.max()}"
        got = forced_top_logprobs(q, asks)
    diffs, agree = [], 0
    for w, g in zip(want, got):
        top = max(w, key=w.get)
        agree += top == max(g, key=g.get)
        if top in g:  # the reference's choice among the quantized model's five likeliest
            diffs.append(abs(w[top] - g[top]))
    assert len(diffs) >= 0.9 * len(want), f"{len(diffs)} of {len(want)}"
    mean = sum(diffs) / len(diffs)
    print(f"\n{scheme}: greedy agreement {agree}/{len(want)}, mean logprob difference {mean:.4f}")
    assert agree >= AGREEMENT[scheme] * len(want)
    assert mean <= MEAN_LOGPROB[scheme]


def test_weights_are_counted_at_their_stored_size(checkpoints):
    from shoal.workers.model_executor.loader.model_loader import weight_bytes

    sizes = {}
    for scheme in ("w4a16", "int8_channel"):
        with LLM(checkpoints(scheme)[0], **ENGINE) as llm:
            model = llm.engine.model_executor.driver_worker.runner.model
            mlp = model.layers[0].mlp.down_proj
            sizes[scheme] = sum(p.nbytes for p in mlp.parameters())
            assert weight_bytes(model) > 0
    k, n = 256, 128  # down_proj: 256 inputs -> 128 outputs
    assert sizes["int8_channel"] == n * k + 4 * n  # one byte a weight, a float32 scale a row
    assert sizes["w4a16"] == n * k // 2 + 4 * n * (k // 128) + 16  # half a byte a weight, a scale a group


def _with_config(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    edit(cfg["quantization_config"])
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda qc: qc["config_groups"]["group_0"]["weights"].update(symmetric=False), "asymmetric"),
        (lambda qc: qc["config_groups"]["group_0"].pop("input_activations"), "int8 weights .* is not served"),
        (lambda qc: qc["config_groups"]["group_0"].update(format="marlin-24"), "format 'marlin-24'"),
        (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "int"}), "kv_cache_scheme type='int'"),
        (lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity"),
        (lambda qc: qc.update(quant_method="awq"), "quant_method 'awq'.*compressed-tensors"),
    ],
)
def test_a_checkpoint_shoal_does_not_serve_is_refused_at_start(checkpoints, tmp_path, edit, match):
    bad = _with_config(checkpoints("int8_channel")[0], str(tmp_path / "bad"), edit)
    with pytest.raises(ValueError, match=match):
        LLM(bad, **ENGINE)


def test_a_quantization_the_checkpoint_contradicts_is_refused(checkpoints):
    with pytest.raises(ValueError, match="compressed-tensors checkpoint.*--quantization fp8 does not apply"):
        LLM(checkpoints("int8_channel")[0], quantization="fp8", **ENGINE)
    with LLM(checkpoints("int8_channel")[0], quantization="compressed-tensors", **ENGINE) as llm:
        assert len(llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_ignored_and_untargeted_layers_stay_float():
    cfg = CompressedTensorsConfig.from_config(
        {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {
                    "g": {
                        "targets": ["re:.*mlp\\.(gate|up|down)_proj$"],
                        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
                    }
                },
                "ignore": ["model.layers.1.mlp.down_proj"],
            }
        }
    )
    layer = torch.nn.Linear(1, 1)
    assert cfg.scheme_for(layer, "model.layers.0.self_attn.qkv_proj") is None  # not targeted
    assert cfg.scheme_for(layer, "model.layers.0.mlp.gate_up_proj").kind == "w8a8_int8"  # both parts targeted
    assert cfg.scheme_for(layer, "model.layers.1.mlp.down_proj") is None  # ignored
    assert cfg.scheme_for(layer, "model.layers.0.mlp.down_proj").strategy == "channel"
    mixed = CompressedTensorsConfig(cfg.groups, ["model.layers.0.mlp.up_proj"])
    with pytest.raises(ValueError, match="different schemes"):
        mixed.scheme_for(layer, "model.layers.0.mlp.gate_up_proj")


def test_tensor_parallelism_never_cuts_a_packed_word_or_a_scale_group():
    from types import SimpleNamespace

    from shoal.workers.model_executor.layers.quantization.compressed_tensors import make_loader

    # rank 1 of 2 of a row-parallel layer with 8 outputs and 192 inputs: 96 each
    layer = SimpleNamespace(output_size=8, input_full=192, input_start=96, tp=SimpleNamespace(size=2, rank=1))
    words = torch.nn.Parameter(torch.zeros(8, 12, dtype=torch.int32), requires_grad=False)
    full = torch.arange(8 * 24, dtype=torch.int32).reshape(8, 24)
    make_loader(layer, True, 8, "weight_packed")(words, full)
    assert torch.equal(words.data, full[:, 12:])  # the second half of each row's words
    scales = torch.nn.Parameter(torch.zeros(8, 3), requires_grad=False)
    make_loader(layer, True, 32, "weight_scale")(scales, torch.arange(48.0).reshape(8, 6))
    assert torch.equal(scales.data, torch.arange(48.0).reshape(8, 6)[:, 3:])
    with pytest.raises(ValueError, match="would cut weight_scale of 128 input features"):
        make_loader(layer, True, 128, "weight_scale")(torch.nn.Parameter(torch.zeros(8, 1)), torch.zeros(8, 2))


@pytest.mark.parametrize("scheme", ["int8_channel", "fp8_channel", "w4a16"])
def test_the_weight_estimate_counts_stored_weights_at_their_size(checkpoints, scheme, monkeypatch):
    """What the GPU's check before loading counts (memory_profiler.estimate_weight_bytes with the
    config's linear_weight_bytes) is what the built model holds, less the few bytes past the
    weights it leaves out; and an fp8 weight is one byte from the start of loading, not widened
    to the model's dtype while the checkpoint is read."""
    from shoal.workers.model_executor.loader.model_loader import build_model, load_model_files
    from shoal.workers.model_executor.memory import memory_profiler as mp
    from shoal.workers.model_executor.models.llama import LlamaForCausalLM

    loaded = load_model_files(checkpoints(scheme)[0])
    quant = CompressedTensorsConfig.from_config(loaded.config.hf_config)
    at_load: set[torch.dtype] = set()
    load_weights = LlamaForCausalLM.load_weights

    def spy(self, weights):
        at_load.update(p.dtype for n, p in self.named_parameters() if n.endswith("_proj.weight"))
        return load_weights(self, weights)

    monkeypatch.setattr(LlamaForCausalLM, "load_weights", spy)
    model = build_model(loaded.config, loaded.weights, 64, torch.device("cpu"), torch.bfloat16, None, False, quant)
    held = sum(p.nbytes for p in model.parameters())
    c = loaded.config
    estimate = mp.estimate_weight_bytes(c, torch.bfloat16, linear_bytes=quant.linear_weight_bytes(torch.bfloat16))
    # Left out: a float32 scale a row (W8A8), the int64 weight_shape of each layer (W4A16).
    rows = (
        (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim + 2 * c.hidden_size + 2 * c.intermediate_size
    )
    extra = c.num_hidden_layers * (4 * 16 if scheme == "w4a16" else 4 * rows)
    assert held == estimate + extra
    assert estimate < mp.estimate_weight_bytes(c, torch.bfloat16) * (0.75 if scheme == "w4a16" else 0.9)
    if scheme == "fp8_channel":
        assert at_load == {torch.float8_e4m3fn}

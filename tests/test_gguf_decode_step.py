"""The one-call CPU decode step (platforms/cpu/decode_step.py, csrc/cpu_decode_layers.cpp)
on GGUF blocks under --quantization gguf.

The C++ layers multiply GGUF blocks with gguf_linear's and gguf_linear_k's
own pieces (the same activation blocks, the same tiles, threads splitting
the weight rows instead of at::parallel_for), so every decode step's logits
are the per-layer path's bit for bit: checked on tiny Llamas whose fused
layers each hold one type (all of Q4_0, Q4_1, Q8_0 on every kind of matrix
between two files; the K-quants in a third), whose fused layers mix types
(a group each, quantizing the input once for each kind of activation block
they need, as a Q4_K_M file mixes Q4_K and Q6_K), at 1 and 2 threads, on
the AVX2 path and, where the CPU has it, the AVX-512 (VNNI) one. A float
part among a fused layer's blocks keeps the per-layer path.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_gguf_quantization import TYPES
from tiny_gguf import write_llama_gguf
from tiny_models import make_tiny_model

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.layers.attention import set_forward_context

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# Each fused layer (q, k, v; gate, up) in one type; between the two files
# every kind of matrix is in each of the three types at least once, or twice.
UNIFORM = {
    "a": {"qkv": Q.Q4_0, "attn_output": Q.Q4_1, "ffn": Q.Q8_0, "ffn_down": Q.Q4_1},
    "b": {"qkv": Q.Q8_0, "attn_output": Q.Q4_0, "ffn": Q.Q4_1, "ffn_down": Q.Q8_0},
}
# q, k and v in three types (q8_0 and q8_1 activation blocks), gate and up in two.
MIXED = TYPES
# The K-quants need rows of 256 (a wider tiny model, random blocks): one type
# a fused layer, then a Q4_K_M-like mix with the 32-value types beside them
# (three kinds of activation blocks in one qkv) and an embedding in Q4_K,
# which Python looks up.
K_UNIFORM = {
    "token_embd": Q.Q8_0,
    "output": Q.Q6_K,
    **{k: Q.Q4_K for k in ("attn_q", "attn_k", "attn_v")},
    "attn_output": Q.Q5_K,
    "ffn_gate": Q.Q6_K,
    "ffn_up": Q.Q6_K,
    "ffn_down": Q.Q4_K,
}
K_MIXED = {
    "token_embd": Q.Q4_K,
    "output": Q.Q4_K,
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q4_1,
    "attn_v": Q.Q6_K,
    "attn_output": Q.Q8_0,
    "ffn_gate": Q.Q4_K,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.Q6_K,
}
# (LM head in the call, embedding in the kernel) for each file.
IN_CALL = {"a": (True, True), "b": (True, True), "mixed": (True, True), "k": (True, True), "k_mixed": (True, False)}


def _types(u: dict[str, int]) -> dict[str, int]:
    return {
        "token_embd": Q.Q8_0,
        "output": Q.Q8_0,
        **{k: u["qkv"] for k in ("attn_q", "attn_k", "attn_v")},
        "attn_output": u["attn_output"],
        "ffn_gate": u["ffn"],
        "ffn_up": u["ffn"],
        "ffn_down": u["ffn_down"],
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("gguf-step")
    hf = make_tiny_model(str(d / "hf"))
    out = {name: write_llama_gguf(hf, str(d / f"{name}.gguf"), _types(u)) for name, u in UNIFORM.items()}
    out["mixed"] = write_llama_gguf(hf, str(d / "mixed.gguf"), {"token_embd": Q.Q8_0, **MIXED})
    wide = make_tiny_model(str(d / "hf-wide"), hidden_size=256, intermediate_size=512)
    out["k"] = write_llama_gguf(wide, str(d / "k.gguf"), K_UNIFORM)
    out["k_mixed"] = write_llama_gguf(wide, str(d / "k_mixed.gguf"), K_MIXED)
    # q in float (as the file keeps it) beside k and v in Q8_0.
    out["float_part"] = write_llama_gguf(hf, str(d / "float_part.gguf"), {"attn_k": Q.Q8_0, "attn_v": Q.Q8_0})
    return out


def _llm(path: str, threads: int) -> LLM:
    return LLM(path, quantization="gguf", num_threads=threads, num_kv_blocks=64, enable_prefix_caching=False)


class _BothPaths:
    """Each decode-only step twice on the same inputs: first the model's
    per-layer forward (the GGUF kernels layer by layer), then the one-call
    step; records both logits. Both write the step's keys and values into
    the same cache slots (the same values where the two agree)."""

    def __init__(self, runner, monkeypatch):
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        model, step = runner.model, runner.cpu_decode_step
        step_forward = step.forward

        def both(input_ids, positions, logits_indices, meta):
            with set_forward_context(meta):  # the layers' attention reads it
                ref = model.forward(input_ids, positions, logits_indices)
            out = step_forward(input_ids, positions, logits_indices, meta)
            self.records.append((ref.clone(), out.clone()))
            return out

        monkeypatch.setattr(step, "forward", both)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def _isas(kernels) -> list[str]:
    return ["avx2", "avx512"] if kernels.has_avx512 else ["avx2"]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("which", sorted(IN_CALL))
def test_decode_steps_on_blocks_equal_the_per_layer_path_bit_for_bit(kernels, files, monkeypatch, which, threads):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = _prompts(7, (1, 9, 40))
    with _llm(files[which], threads) as llm:
        runner = llm.engine.runner
        assert runner.cpu_decode_step is not None, f"the one-call step refused the layers of {which}"
        head, embedding = IN_CALL[which]
        assert runner.cpu_decode_step.head_in_call == head
        assert runner.cpu_decode_step.embedding_in_kernel == embedding
        for isa in _isas(kernels):
            previous = kernels.set_isa(isa)
            try:
                with monkeypatch.context() as m:
                    both = _BothPaths(runner, m)
                    llm.generate(prompts, params)  # 3-row decodes, then one alone
                    llm.generate(prompts[1:2], params)  # 1-row decodes
            finally:
                kernels.set_isa(previous)
            assert len(both.records) == 2 * (params.max_tokens - 1), len(both.records)
            for i, (ref, out) in enumerate(both.records):
                assert torch.equal(out, ref), f"{isa}, decode step {i}: max |diff| {(out - ref).abs().max().item()}"


def test_greedy_tokens_equal_the_per_layer_path(kernels, files, monkeypatch):
    """Generation as the runner runs it, the one-call step against a runner without one."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = _prompts(8, (1, 5, 23, 60))
    with _llm(files["a"], 2) as llm:
        assert llm.engine.runner.cpu_decode_step is not None
        got = [o.token_ids for o in llm.generate(prompts, params)]
        llm.engine.runner.cpu_decode_step = None  # every step on the per-layer path
        want = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want


def test_a_float_part_among_blocks_keeps_the_per_layer_path(kernels, files):
    """A fused layer whose q is float and k, v blocks: the C++ layers take
    a matrix in float or in blocks, not both."""
    with _llm(files["float_part"], 1) as llm:
        assert llm.engine.runner.cpu_decode_step is None
        out = llm.generate(_prompts(9, (4,)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out[0].token_ids) == 3


@pytest.mark.parametrize("which", ["b", "k_mixed"])  # a Q8_0 head, a Q4_K head
def test_head_at_some_rows_and_while_timed_equals_compute_logits(kernels, files, monkeypatch, which):
    """The C++ final norm and LM head at a subset of the rows (a row not due
    a token), and the Python head the step falls back to while its ops are
    timed (bench latency --profile), against the model's compute_logits."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with _llm(files[which], 2) as llm:
        runner = llm.engine.runner
        step = runner.cpu_decode_step
        assert step.head_in_call
        seen = []
        forward = step.forward

        def check(input_ids, positions, logits_indices, meta):
            g = meta.decode
            layers = step.bound_layers()
            args = (positions, meta.slot_mapping, g.block_tables, g.context_lens)
            h = runner.model.get_input_embeddings(input_ids)
            x, residual = layers(h.clone(), *args)
            for rows in (logits_indices, logits_indices[-1:], logits_indices.flip(0)):
                want = runner.model.compute_logits(x, residual.clone(), rows)
                assert torch.equal(layers.logits(h.clone(), *args, rows), want)
            layers.timing = True  # the Python head
            try:
                timed = forward(input_ids, positions, logits_indices, meta)
            finally:
                layers.timing = False
                layers.op_seconds()
            out = forward(input_ids, positions, logits_indices, meta)
            assert torch.equal(timed, out)
            seen.append(len(logits_indices))
            return out

        monkeypatch.setattr(step, "forward", check)
        llm.generate(_prompts(10, (3, 17, 30)), params)
    assert seen and max(seen) == 3


def test_argmax_rows_is_torch_argmax(kernels):
    """The greedy sampler's argmax: the first of equal maxima, the first NaN, all -inf."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 16, 17, 33, 1000):
        for case in range(5):
            x = torch.randn(3, n, generator=g)
            if case == 1:
                x = x.round()  # ties
            elif case == 2:
                x[1, torch.randint(0, n, (2,), generator=g)] = float("nan")
            elif case == 3:
                x[:] = float("-inf")
            elif case == 4:
                x = torch.zeros(3, n)
                x[:, n // 2 :] = -0.0
            assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1)), (n, case)


@pytest.mark.parametrize("ggml_type", [Q.Q8_0, Q.Q4_0])
def test_gguf_embedding_is_dequantize(kernels, ggml_type):
    """The step's lookup against gguf.py's dequantize of the same rows."""
    from shoal.workers.model_executor.platforms.cpu.gguf_blocks import dequantize

    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1)).numpy()
    blocks = torch.from_numpy(gguf.quants.quantize(w, ggml_type))
    ids = torch.tensor([3, 0, 39, 3])
    want = dequantize(blocks.index_select(0, ids), int(ggml_type), 96)
    packed = kernels.gguf_pack(blocks, int(ggml_type))  # 2 groups of 16 rows, 8 as stored
    assert torch.equal(kernels.gguf_embedding(ids, packed, int(ggml_type)), want)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.gguf_embedding(torch.tensor([40]), packed, int(ggml_type))

"""CUDA graphs for decode steps: the bucket sizes, the padding, and the
static input buffer a step is copied into.

Off CUDA the graphs replay eagerly over the same padded static buffer, so
everything but the capture itself runs here: the engine's greedy tokens
with decode steps padded to buckets must equal those of plain steps. On a
GPU, a replayed graph must equal the eager step.
"""

from __future__ import annotations

import os

# The Triton kernel runs interpreted on the CPU; set before it is first imported.
# The GPU check compiles (SHOAL_TRITON_COMPILED=1), as the other Triton tests.
if not os.environ.get("SHOAL_TRITON_COMPILED"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random

import pytest
import torch

pytest.importorskip("triton", reason="the padded decode path runs the Triton kernel")

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.runner.cuda_graph import capture_sizes, padded_batch_size
from shoal.workers.model_executor.runner.staging_buffer import StagingBuffer


@pytest.mark.parametrize(
    "max_num_seqs, sizes",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (256, [1, 2, 4, *range(8, 257, 8)]),
    ],
)
def test_capture_sizes(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


def test_capture_sizes_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_a_batch_pads_to_the_smallest_bucket_that_holds_it():
    sizes = capture_sizes(256)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 255, 256)] == [1, 2, 4, 8, 8, 16, 24, 256, 256]
    assert padded_batch_size(257, sizes) is None  # eager


def test_staged_views_keep_their_layout_in_another_buffer():
    batch = StagingBuffer(torch.device("cpu")).begin()
    batch.add("ids", [5, 6, 7], torch.long)
    batch.add("table", [[1, 2], [3, 4]], torch.int32, (2, 2))
    batch.add("lens", [9, 10], torch.int32)
    got = batch.upload()
    other = torch.zeros(batch.nbytes, dtype=torch.uint8)
    other.copy_(batch.device_bytes[: batch.nbytes])
    views = batch.views(other)
    for name in got:
        assert torch.equal(views[name], got[name]) and views[name].data_ptr() != got[name].data_ptr()
    assert got["table"].tolist() == [[1, 2], [3, 4]] and got["ids"].dtype == torch.long


def _generate(tiny_model: str, padded: bool, budget: int = 64, **engine):
    llm = LLM(
        tiny_model,
        dtype="float32",
        attention_backend="triton",
        max_num_batched_tokens=budget,
        num_kv_blocks=48,
        max_num_seqs=4,
        **engine,
    )
    if padded:
        stats = llm.engine.runner.capture_cudagraphs()
        assert stats.num_graphs == 0  # no CUDA: replayed eagerly
    rng = random.Random(7)
    # Ragged prompts and outputs: decode batches of 4, 3, 2 and 1 rows, the 3 padded to 4.
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 30, 5)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 2, 4, 5)]
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    return tokens, llm.engine.runner


# A budget of 5 tokens makes steps of decodes beside a one-token chunk of a
# prompt: one-token rows that are not due a token, which must run eagerly.
@pytest.mark.parametrize("budget", [64, 5])
def test_decode_steps_padded_to_buckets_give_the_plain_steps_tokens(tiny_model, budget):
    plain, runner = _generate(tiny_model, padded=False, budget=budget)
    assert runner.graphs is None
    padded, runner = _generate(tiny_model, padded=True, budget=budget)
    assert runner.graphs.num_replays > 0
    assert padded == plain
    # The padding rows wrote only to the spare block past the block manager's.
    assert runner.pad_block == 48 and runner.kv_cache.shape[2] == 49


def test_decode_steps_staged_ahead_replay_to_the_plain_steps_tokens(tiny_model):
    """Async scheduling stages a step while the one before computes: its
    placeholders are filled in the staged buffer the graph's static inputs
    are copied from, so padded replays give the same tokens."""
    plain, _ = _generate(tiny_model, padded=False)
    ahead, runner = _generate(tiny_model, padded=True, async_scheduling=True)
    assert runner.graphs.num_replays > 0
    assert ahead == plain


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="replaying a captured graph needs CUDA")
def test_steps_scheduled_ahead_on_a_gpu_give_the_eager_steps_tokens(tiny_model):
    """On a GPU: steps staged ahead (async scheduling: the pinned staging buffers
    in turn, placeholders filled on the device) and replayed as graphs."""
    eager, _ = _generate_cuda(tiny_model, enforce_eager=True)
    ahead, runner = _generate_cuda(tiny_model, enforce_eager=False, async_scheduling=True)
    assert runner.graphs is not None and runner.graphs.num_replays > 0
    assert ahead == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="replaying a captured graph needs CUDA")
def test_a_replayed_graph_equals_the_eager_step(tiny_model):
    eager, _ = _generate_cuda(tiny_model, enforce_eager=True)
    graphed, runner = _generate_cuda(tiny_model, enforce_eager=False)
    assert runner.graphs is not None and runner.graphs.num_replays > 0
    assert graphed == eager


def _generate_cuda(tiny_model: str, enforce_eager: bool, **engine):
    # A fixed cache: sized from free memory, the first engine's would leave the second none.
    with LLM(
        tiny_model,
        device="cuda",
        dtype="float32",
        max_num_seqs=6,
        num_kv_blocks=64,
        enforce_eager=enforce_eager,
        **engine,
    ) as llm:
        rng = random.Random(7)
        prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 30, 5, 41, 9)]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts, params)], llm.engine.runner


def _generate_lora(tiny_model: str, adapters: list[str], padded: bool, **engine):
    """Ragged prompts, each under an adapter (or the base) in turn, over fewer slots than adapters."""
    from shoal.workers.lora import LoRARequest

    llm = LLM(tiny_model, dtype="float32", num_kv_blocks=48, max_num_seqs=4, enable_lora=True, max_loras=2, **engine)
    if padded:
        assert llm.engine.runner.capture_cudagraphs().num_graphs == 0  # no CUDA: replayed eagerly
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 30, 5, 12, 8)]
    loras = [None, *(LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters))]
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 2, 4, 5, 7, 3)]
    out = [o.token_ids for o in llm.generate(prompts, params, lora_request=per_prompt)]
    return out, llm.engine.runner


def test_lora_decode_steps_padded_to_buckets_give_the_plain_steps_tokens(tiny_model, tmp_path):
    """Each token's adapter slot rides in the static buffer (padding rows: the
    base), so a LoRA step replays a captured graph: same tokens as plain steps."""
    pytest.importorskip("peft")
    from test_lora_adapter import make_adapter

    adapters = [make_adapter(tiny_model, str(tmp_path / f"a{r}"), r, seed=r) for r in (4, 8, 16)]
    plain, runner = _generate_lora(tiny_model, adapters, padded=False, attention_backend="triton")
    assert runner.graphs is None
    padded, runner = _generate_lora(tiny_model, adapters, padded=True, attention_backend="triton")
    assert runner.graphs.num_replays > 0 and runner.lora_manager.num_slot_fills > 2
    assert padded == plain


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="replaying a captured graph needs CUDA")
def test_a_replayed_lora_graph_equals_the_eager_step(tiny_model, tmp_path):
    """On a GPU: LoRA decode steps through the Triton kernels, captured once and
    replayed while adapters swap through the slots, equal the eager steps, which
    the adapters do change. The adapters are written without peft (the GPU machine has none)."""
    from shoal.benchmarks.lora import write_adapter
    from shoal.workers.model_executor.loader.model_loader import load_model_files

    config = load_model_files(tiny_model).config
    adapters = [write_adapter(str(tmp_path / f"a{r}"), config, r, seed=r, b_std=0.5) for r in (4, 8, 16)]
    eager, _ = _generate_lora(tiny_model, adapters, padded=False, device="cuda", enforce_eager=True)
    graphed, runner = _generate_lora(tiny_model, adapters, padded=False, device="cuda")
    assert runner.graphs is not None and runner.graphs.num_replays > 0
    assert graphed == eager
    base, _ = _generate_lora(tiny_model, [], padded=False, device="cuda", enforce_eager=True)
    assert base != eager  # the adapters change the tokens: equal graphs prove something

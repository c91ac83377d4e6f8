"""LoRA adapters in the engine (--enable-lora): a batch mixing the base
model and three peft adapters (ranks 4, 8 and 16 on all seven projections,
random A and B) gives each request transformers + peft's greedy tokens,
with max_loras=2 so that adapters swap in and out of the slots mid-run,
under every scheduler regime (preemption and chunked prefill included);
the prefix cache never serves one adapter's blocks to another or to the
base; and every bad adapter or request is refused before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference import check_setting, check_tokens, hf_greedy
from regimes import MAX_NEW, SETTINGS, prompts_for
from test_lora_adapter import make_adapter

from shoal.proto.errors import InvalidRequestError
from shoal.proto.messages import GenerateRequest
from shoal.workers import LLM, SamplingParams
from shoal.workers.lora import LoRARequest

peft = pytest.importorskip("peft")
RANKS = {"alpha": 4, "beta": 8, "gamma": 16}
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, LoRARequest]:
    d = tmp_path_factory.mktemp("lora-engine")
    return {
        name: LoRARequest(name, i + 1, make_adapter(tiny_model, str(d / name), rank, seed=10 + i))
        for i, (name, rank) in enumerate(RANKS.items())
    }


@pytest.fixture(scope="module")
def references(tiny_model, adapters):
    """(base model, adapter name) -> transformers (+ peft) model, float32."""
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    out = {None: base()}
    for name, req in adapters.items():
        out[name] = peft.PeftModel.from_pretrained(base(), req.lora_path).eval()
    return out


def _assign(prompts, adapters) -> list[LoRARequest | None]:
    """Base, alpha, beta, gamma, base, ... in turn."""
    cycle = [None, *adapters.values()]
    return [cycle[i % len(cycle)] for i in range(len(prompts))]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_mixed_adapters_give_transformers_peft_tokens(tiny_model, adapters, references, setting):
    eos = None
    with LLM(tiny_model, dtype="float32", enable_lora=True, max_loras=2, **SETTINGS[setting]) as llm:
        eos = llm.engine.eos_token_ids
        prompts = prompts_for(setting, llm.engine.model_config.vocab_size)
        loras = _assign(prompts, adapters)
        outs = llm.generate(prompts, GREEDY, lora_request=loras)
        stats = llm.engine.stats()
        table, manager = llm.engine.scheduler.lora_table, llm.engine.runner.lora_manager
        assert table.num_loads > 2 and manager.num_slot_fills == table.num_loads  # 3 adapters through 2 slots
        assert not table.active  # every pin released
    notes = []
    for p, o, lora in zip(prompts, outs, loras):
        model = references[None if lora is None else lora.lora_name]
        (ref,) = hf_greedy(model, [p], MAX_NEW, eos)
        notes.append(check_tokens(model, p, o.token_ids, ref))
    check_setting(stats, setting, notes)


def test_an_adapter_changes_the_tokens(tiny_model, adapters):
    """The adapters are not near zero: each one's tokens differ from the base's on most prompts."""
    prompts = prompts_for("plain", 512)[3:9]
    with LLM(tiny_model, dtype="float32", enable_lora=True, max_loras=3) as llm:
        base = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        for req in adapters.values():
            tuned = [o.token_ids for o in llm.generate(prompts, GREEDY, lora_request=req)]
            assert sum(a != b for a, b in zip(base, tuned)) >= 4, req.lora_name


def test_the_prefix_cache_never_crosses_adapters(tiny_model, adapters):
    prompt = prompts_for("plain", 512)[10]  # 150 tokens: 9 full blocks
    one = SamplingParams(temperature=0, max_tokens=1)
    with LLM(tiny_model, dtype="float32", enable_lora=True, max_loras=2) as llm:
        pool = llm.engine.block_manager.pool

        def hit_tokens(lora):
            before = pool.num_hit_tokens
            llm.generate([prompt], one, lora_request=lora)
            return pool.num_hit_tokens - before

        assert hit_tokens(adapters["alpha"]) == 0
        assert hit_tokens(adapters["beta"]) == 0  # the same prompt under another adapter: no hit
        assert hit_tokens(None) == 0  # nor for the base
        own = hit_tokens(adapters["alpha"])  # its own blocks: hits
        assert own > 0 and hit_tokens(None) == own and hit_tokens(adapters["beta"]) == own


def test_bad_adapters_and_requests_are_refused_before_anything_runs(tiny_model, adapters, tmp_path):
    prompt = [5, 6, 7]
    with LLM(tiny_model, dtype="float32", num_kv_blocks=64) as llm:
        with pytest.raises(InvalidRequestError, match="need --enable-lora"):
            llm.generate([prompt], GREEDY, lora_request=adapters["alpha"])
    with LLM(tiny_model, dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=64) as llm:
        with pytest.raises(InvalidRequestError, match="rank 16 is above --max-lora-rank 8"):
            llm.generate([prompt, prompt], GREEDY, lora_request=[adapters["alpha"], adapters["gamma"]])
        with pytest.raises(InvalidRequestError, match="cannot be loaded from this lora_path"):
            llm.generate([prompt], GREEDY, lora_request=LoRARequest("ghost", 9, str(tmp_path)))
        llm.generate([prompt], GREEDY, lora_request=adapters["alpha"])
        with pytest.raises(InvalidRequestError, match="lora_int_id 1 is adapter 'alpha' already"):
            llm.generate([prompt], GREEDY, lora_request=LoRARequest("other", 1, adapters["beta"].lora_path))
        with pytest.raises(ValueError, match="got 2 LoRA requests for 1 prompts"):
            llm.generate([prompt], GREEDY, lora_request=[None, None])
        assert not llm.engine.has_unfinished_requests()  # nothing of a refused batch was queued
        out = llm.generate([prompt], GREEDY, lora_request=adapters["beta"])  # and the engine still serves
        assert len(out[0].token_ids) == MAX_NEW


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(max_loras=0), "max_loras must be an integer >= 1"),
        (dict(max_lora_rank=0), "max_lora_rank must be an integer >= 1"),
        (dict(max_loras=2, max_cpu_loras=1), "max_cpu_loras must be an integer >= max_loras"),
    ],
)
def test_bad_lora_settings_are_refused_at_start(tiny_model, args, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model, enable_lora=True, **args)


def test_the_async_engine_streams_an_adapter_as_the_offline_front_runs_it(tiny_model, adapters):
    """AsyncEngine.add_lora, then generate(request) naming it, through the engine-core thread."""
    import asyncio

    from shoal.workers import AsyncEngine

    prompt = prompts_for("plain", 512)[6]
    with LLM(tiny_model, dtype="float32", enable_lora=True) as llm:
        want = llm.generate([prompt], GREEDY, lora_request=adapters["gamma"])[0].token_ids

    async def main():
        engine = AsyncEngine.from_engine_args(model=tiny_model, dtype="float32", enable_lora=True)
        try:
            tokens, ids = [], engine.engine.tokenize(prompt)
            await engine.add_lora(adapters["gamma"])
            async for delta in engine.generate(
                GenerateRequest("r", ids, GREEDY, lora_name=adapters["gamma"].lora_name)
            ):
                tokens += delta.new_token_ids
            with pytest.raises(InvalidRequestError, match="cannot be loaded from this lora_path"):
                await engine.add_lora(LoRARequest("x", 7, "/nonexistent"))
            with pytest.raises(InvalidRequestError, match="'x' is not loaded"):
                async for _ in engine.generate(GenerateRequest("bad", ids, GREEDY, lora_name="x")):
                    pass
            return tokens
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == want


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_other_architectures_give_transformers_peft_tokens(kind, tmp_path):
    """Qwen3 (q/k norms) with all seven projections; a mixture of experts
    with adapters on attention (its experts take none: an adapter on a sparse
    layer's MLP is refused by name)."""
    from tiny_models import make_tiny_model

    from shoal.benchmarks.lora import write_adapter
    from shoal.workers.model_executor.loader.model_loader import load_model_files

    base = make_tiny_model(str(tmp_path / kind), kind)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj"] if kind == "qwen3_moe" else None
    extra = {} if modules is None else {"target_modules": modules}
    reqs = [
        LoRARequest(f"{kind}-{r}", i + 1, make_adapter(base, str(tmp_path / f"a{r}"), r, 20 + r, **extra))
        for i, r in enumerate((4, 8))
    ]
    prompts = prompts_for("plain", 512)[:9]
    loras = [[None, *reqs][i % 3] for i in range(len(prompts))]
    with LLM(base, dtype="float32", enable_lora=True, max_loras=2) as llm:
        outs = llm.generate(prompts, GREEDY, lora_request=loras)
        eos = llm.engine.eos_token_ids
        if kind == "qwen3_moe":
            mlp = write_adapter(str(tmp_path / "mlp"), load_model_files(base).config, 4, 0)  # all seven, every layer
            with pytest.raises(InvalidRequestError, match="MLP is a mixture of experts, whose experts take no adapter"):
                llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest("mlp", 9, mlp))
    from transformers import AutoModelForCausalLM

    notes = []
    for p, o, lora in zip(prompts, outs, loras):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        if lora is not None:
            model = peft.PeftModel.from_pretrained(model, lora.lora_path).eval()
        (ref,) = hf_greedy(model, [p], MAX_NEW, eos)
        notes.append(check_tokens(model, p, o.token_ids, ref))
    assert sum(n is not None for n in notes) <= 1, notes


def test_bfloat16_slots_compute_the_rounded_adapters_in_float32(tiny_model, adapters):
    """--lora-dtype bfloat16 under a float32 model: half the bytes, and the
    tokens of transformers + peft with the adapters' weights rounded to bfloat16."""
    from transformers import AutoModelForCausalLM

    prompts = prompts_for("plain", 512)[2:10]
    req = adapters["beta"]
    with LLM(tiny_model, dtype="float32", enable_lora=True, lora_dtype="bfloat16") as llm:
        layer = llm.engine.runner.lora_manager.layers[0]["q_proj"]
        assert layer.parts[0].lora_a.dtype == torch.bfloat16
        outs = llm.generate(prompts, GREEDY, lora_request=req)
        eos = llm.engine.eos_token_ids
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, req.lora_path).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(p.bfloat16().float())
    notes = [check_tokens(model, p, o.token_ids, hf_greedy(model, [p], MAX_NEW, eos)[0]) for p, o in zip(prompts, outs)]
    assert sum(n is not None for n in notes) <= 1, notes


def _run(engine, reqs) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Add (request id, prompt, lora) all at once, step to the end: tokens and errors by request id."""
    for rid, prompt, lora in reqs:
        if lora is not None:
            engine.register_lora(lora)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        name = None if lora is None else lora.lora_name
        engine.add_request(GenerateRequest(rid, engine.tokenize(prompt), params, lora_name=name))
    got = {rid: [] for rid, _, _ in reqs}
    errors = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.error is not None:
                errors[out.request_id] = out.error
    return got, errors


def test_an_adapter_changed_on_disk_is_served_from_the_tensors_held(tiny_model, adapters, tmp_path):
    """The tensors checked at load are the ones served: overwriting the file
    (with garbage, with another rank's valid file) changes nothing; once the
    adapter is evicted from host memory its rereading is refused, that request
    alone (400), until its files are what they were."""
    import shutil

    from shoal.workers import LLMEngine

    own = LoRARequest("own", 11, shutil.copytree(adapters["alpha"].lora_path, str(tmp_path / "own")))
    weights = tmp_path / "own" / "adapter_model.safetensors"
    original = weights.read_bytes()
    prompt = prompts_for("plain", 512)[4]
    engine = LLMEngine(model=tiny_model, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1)
    try:
        want, base = _run(engine, [("a0", prompt, own), ("b0", prompt, None)])[0].values()
        assert want != base
        for content in (b"\x00garbage" * 1000, (Path(adapters["beta"].lora_path) / weights.name).read_bytes()):
            weights.write_bytes(content)
            assert _run(engine, [("a1", prompt, own), ("b1", prompt, None)]) == ({"a1": want, "b1": base}, {})
        # Two other adapters through the one slot: `own` leaves host memory (capacity 1).
        _run(engine, [("x", prompt, adapters["beta"])])
        _run(engine, [("y", prompt, adapters["gamma"])])
        assert own.lora_int_id not in engine.lora_host.ids()
        with pytest.raises(InvalidRequestError, match=r"has A \(8, "):  # beta's rank-8 file
            _run(engine, [("a2", prompt, own)])
        weights.write_bytes(b"\x00garbage")
        with pytest.raises(InvalidRequestError, match="cannot be loaded from this lora_path"):
            _run(engine, [("a3", prompt, own)])
        # A valid adapter of the same shapes, but not the one loaded: refused all the same.
        make_adapter(tiny_model, str(tmp_path / "other"), 4, seed=99)
        weights.write_bytes((tmp_path / "other" / weights.name).read_bytes())
        with pytest.raises(InvalidRequestError, match="changed on disk since it was loaded"):
            _run(engine, [("a4", prompt, own)])
        assert _run(engine, [("b2", prompt, None)])[1] == {}  # the engine serves on
        weights.write_bytes(original)  # its own files again: read back, and the same tokens
        assert _run(engine, [("a5", prompt, own)]) == ({"a5": want}, {})
    finally:
        engine.shutdown()


def test_a_slot_fill_that_fails_fails_only_that_adapters_requests(tiny_model, adapters, monkeypatch):
    """A fill that raises inside a step (injected) is pinned on the adapter's
    requests by the failure isolation, whose probes carry the step's slots:
    they fail alone; the base model's and another adapter's requests in the
    same steps give their undisturbed tokens, and the engine lives."""
    from shoal.workers import LLMEngine
    from shoal.workers.fault_injection import ENV

    prompts = prompts_for("plain", 512)[:6]
    loras = [None, adapters["alpha"], adapters["beta"]] * 2
    reqs = [(f"r{i}", p, lora) for i, (p, lora) in enumerate(zip(prompts, loras))]

    def engine():
        return LLMEngine(model=tiny_model, dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=128)

    ref_engine = engine()
    ref, ref_errors = _run(ref_engine, reqs)
    ref_engine.shutdown()
    assert not ref_errors
    monkeypatch.setenv(ENV, "lora=alpha")
    faulty = engine()
    try:
        got, errors = _run(faulty, reqs)
        assert set(errors) == {"r1", "r4"}  # alpha's, and only they
        assert all("injected LoRA slot fault" in e for e in errors.values())
        assert {rid: got[rid] for rid in got if rid not in errors} == {
            rid: ref[rid] for rid in ref if rid not in errors
        }
        assert faulty.num_steps > 0 and not faulty.requests
        assert _run(faulty, [("base", prompts[0], None)]) == ({"base": ref["r0"]}, {})
    finally:
        faulty.shutdown()

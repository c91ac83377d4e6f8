"""Slow tier: LoRA adapters in a served cluster (a real Ray cluster, two
workers with --max-loras 1 and --max-cpu-loras 2, four adapters made by
peft, kv routing). Over HTTP through the official openai client, each
adapter's greedy text equals the offline engine's under it, and once every
adapter has been placed, at least 90% of each adapter's requests go to the
worker that took it first: the router scores residency like a prefix hit,
and spreads new adapters over the workers. An adapter loaded at run time
outlives the worker that loaded it: Serve's replacement of a killed worker
serves it too."""

from __future__ import annotations

import random
import time

import httpx
import openai
import pytest
from serving import local_cluster_app
from test_failover_cluster import kill_process
from test_lora_adapter import make_adapter

from shoal.proto.lora.registry import GcsLoRARegistry
from shoal.workers import LLM, SamplingParams
from shoal.workers.lora import LoRARequest

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")
NAMES = ("a1", "a2", "a3", "a4")
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]
MAX = 12
ROUNDS = 6


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("lora-cluster")
    return {name: make_adapter(tiny_model, str(d / name), 4 * (i + 1), seed=40 + i) for i, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def offline(tiny_model, adapters) -> dict[tuple[str, str], str]:
    """(adapter, prompt) -> the offline engine's greedy text."""
    params = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    out = {}
    with LLM(tiny_model, dtype="float32", enable_lora=True, max_loras=4, num_threads=1) as llm:
        for i, (name, path) in enumerate(adapters.items()):
            for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, lora_request=LoRARequest(name, i + 1, path))):
                out[name, p] = o.text
    return out


def _options(tiny_model, **kw) -> dict:
    return dict(
        model=tiny_model, num_threads=1, num_kv_blocks=128, dtype="float32", enable_lora=True, max_loras=1, **kw
    )


def _finished(base: str) -> dict[str, int]:
    workers = httpx.get(f"{base}/api/status", timeout=30).json()["workers"]
    return {w["worker"]: w["num_finished_requests"] for w in workers}


def test_adapters_over_http_equal_offline_and_stay_on_their_worker(tiny_model, adapters, offline):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    with local_cluster_app(
        "shoal-lora", **_options(tiny_model, num_workers=2, max_cpu_loras=2, lora_modules=modules, routing="kv")
    ) as (base, _):
        with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as client:
            listed = client.models.list().data
            assert sorted((m.id, m.parent) for m in listed[1:]) == [(n, listed[0].id) for n in NAMES]
            where: dict[str, list[str]] = {n: [] for n in NAMES}
            before = _finished(base)
            assert len(before) == 2
            rng = random.Random(5)
            for r in range(ROUNDS):
                order = list(NAMES) if r == 0 else rng.sample(NAMES, len(NAMES))  # no policy gets it by turns
                for name in order:
                    prompt = PROMPTS[r % len(PROMPTS)]
                    out = client.completions.create(
                        model=name,
                        prompt=prompt,
                        max_tokens=MAX,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    assert out.model == name
                    assert out.choices[0].text == offline[name, prompt], (name, prompt)
                    after = _finished(base)
                    (worker,) = [w for w in after if after[w] != before.get(w)]
                    where[name].append(worker)
                    before = after
    # Placed in the first round; from then on each adapter stays where it went first.
    used = {w for ws in where.values() for w in ws}
    assert len(used) == 2, where  # the four adapters spread over both workers
    for name, workers in where.items():
        later = workers[1:]
        share = sum(w == workers[0] for w in later) / len(later)
        assert share >= 0.9, (name, workers)


def _workers(base: str, headers: dict) -> list[str]:
    try:
        return [w["worker"] for w in httpx.get(f"{base}/api/status", headers=headers, timeout=30).json()["workers"]]
    except (httpx.HTTPError, KeyError, ValueError):
        return []


def test_a_replaced_worker_serves_the_adapters_loaded_at_run_time(tiny_model, adapters, offline):
    """Runtime loads are kept in the application's registry in Ray's GCS, so
    the worker Serve starts in place of a killed one loads them at its start."""
    key, app = "lora-key", "shoal-lora-rt"
    headers = {"Authorization": f"Bearer {key}"}
    with local_cluster_app(
        app, **_options(tiny_model, num_workers=1, api_key=key, allow_runtime_lora_updating=True)
    ) as (base, _):
        body = {"lora_name": "a2", "lora_path": adapters["a2"]}
        r = httpx.post(f"{base}/v1/load_lora_adapter", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        (victim,) = _workers(base, headers)
        kill_process(victim, app)
        deadline = time.monotonic() + 180
        while (now := _workers(base, headers)) in ([], [victim]):  # until Serve's replacement reports
            assert time.monotonic() < deadline, "the killed worker was never replaced"
            time.sleep(0.5)
        with openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0) as client:
            assert "a2" in {m.id for m in client.models.list().data}
            out = client.completions.create(
                model="a2", prompt=PROMPTS[1], max_tokens=MAX, temperature=0, extra_body={"ignore_eos": True}
            )
        assert out.choices[0].text == offline["a2", PROMPTS[1]]
        assert _workers(base, headers) == now  # served by the replacement
        registry = GcsLoRARegistry(app)  # (this process is the cluster's driver)
        assert [(n, e.lora_path) for n, e in registry.entries().items()] == [("a2", adapters["a2"])]
        assert GcsLoRARegistry("another-app").entries() == {}  # one application's, not the cluster's
        r = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        assert registry.entries() == {}

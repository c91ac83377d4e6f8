"""LoRA adapters served over HTTP and gRPC (vLLM's interface): --lora-modules,
the request's `model` naming an adapter, /v1/models with `parent`, runtime
/v1/load_lora_adapter and /v1/unload_lora_adapter (403 without the flag,
409 while in use, 404 for a name served nowhere), gRPC GenerateRequest.lora
and GetModelInfo, the shoal:lora_requests_info gauge, the status page and
the spans. In process: two real Workers behind a LocalWorkerPool (kv
routing), the official openai client over ASGI; each adapter's text equals
the offline engine's under the same adapter."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from contextlib import asynccontextmanager

import grpc
import httpx
import openai
import pytest
from serving import grpc_server
from test_lora_adapter import make_adapter

from shoal.benchmarks.otlp_sink import OtlpCollector
from shoal.cluster.options import ServeOptions
from shoal.proto.lora.modules import LORA_UNAVAILABLE, parse_lora_modules, stable_lora_id
from shoal.proto.lora.registry import LocalLoRARegistry, RuntimeLoRA
from shoal.proto.messages import GenerateRequest, WorkerError
from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.router.fronts.frontend import Frontend, ModelInfo
from shoal.router.fronts.openai_app import OpenAIApp
from shoal.router.routing.worker_pool import LocalWorkerPool
from shoal.workers import LLM, EngineArgs, SamplingParams
from shoal.workers.lora import LoRARequest
from shoal.workers.worker import Worker

pytest.importorskip("peft")
KEY = "secret-key"
PROMPT = [5, 17, 99, 3, 250, 41, 8, 77, 12, 301, 64, 2, 9]
MAX = 12
RANKS = {"alpha": 4, "beta": 8, "gamma": 16}


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("lora-serving")
    return {name: make_adapter(tiny_model, str(d / name), r, seed=20 + r) for name, r in RANKS.items()}


@pytest.fixture(scope="module")
def offline(tiny_model, adapters) -> dict[str | None, list[int]]:
    """Greedy tokens of PROMPT on the base and under each adapter, from the offline engine."""
    params = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    with LLM(tiny_model, dtype="float32", enable_lora=True, max_loras=3, num_threads=1) as llm:
        out = {None: llm.generate([PROMPT], params)[0].token_ids}
        for i, (name, path) in enumerate(adapters.items()):
            out[name] = llm.generate([PROMPT], params, lora_request=LoRARequest(name, i + 1, path))[0].token_ids
    assert len({tuple(v) for v in out.values()}) == 4  # each adapter changes the tokens
    return out


def _modules(adapters) -> list[str]:
    """alpha as name=path, beta as vLLM's JSON form; gamma is left for a runtime load."""
    return [f"alpha={adapters['alpha']}", json.dumps({"name": "beta", "path": adapters["beta"]})]


def _engine_args(tiny_model, adapters, **kw) -> EngineArgs:
    return EngineArgs(
        model=tiny_model,
        dtype="float32",
        num_threads=1,
        num_kv_blocks=128,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
        lora_modules=_modules(adapters),
        **kw,
    )


@asynccontextmanager
async def serving(tiny_model, adapters, allow: bool = True, num_workers: int = 2, names: bool = False, **engine):
    """Yields (frontend, workers, openai client, raw httpx client); the routers'
    and workers' shared LoRA registry is fe.lora.registry. names:
    --metrics-include-lora-names; engine: more EngineArgs (lora_root and
    max_runtime_loras reach the router too, as ServeOptions hands them on)."""
    args = _engine_args(tiny_model, adapters, **engine)
    registry = LocalLoRARegistry()
    workers = [Worker(args, max_waiting=64, lora_registry=registry) for _ in range(num_workers)]
    info = ModelInfo.from_worker_info(workers[0].info(), num_workers)
    fe = Frontend(
        LocalWorkerPool(workers),
        workers[0].engine.engine.tokenizer,
        info,
        KEY,
        64,
        1,
        allow,
        registry,
        lora_root=args.lora_root,
        max_runtime_loras=args.max_runtime_loras,
        metrics_include_lora_names=names,
    )
    app = OpenAIApp(fe, ServeOptions().max_request_bytes).app
    transport = httpx.ASGITransport(app=app)
    try:
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://shoal") as raw,
            openai.AsyncOpenAI(
                base_url="http://shoal/v1",
                api_key=KEY,
                max_retries=0,
                http_client=httpx.AsyncClient(transport=transport, base_url="http://shoal"),
            ) as client,
        ):
            yield fe, workers, client, raw
    finally:
        for w in workers:
            await w.engine.shutdown()


def _ids(fe, text: str) -> list[int]:
    return fe.tokenizer.encode(text, add_special_tokens=False)


async def _complete(client, model: str, **kw):
    return await client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX, temperature=0, extra_body={"ignore_eos": True}, **kw
    )


async def _hold(fe, lora: str):
    """A request under `lora` in flight (its first delta read, the rest left
    unread): in use until the stream is closed."""
    # Long enough that it is still running after its first token on any machine (the metrics test stalls it there).
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    stream = fe.generate(PROMPT, params, fe.new_request_id("hold"), lora_name=lora)
    await anext(stream)
    return stream


def _post(raw, path: str, body: dict, key: str | None = KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return raw.post(path, json=body, headers=headers)


def test_adapters_by_model_name_equal_the_offline_engine(tiny_model, adapters, offline):
    async def main():
        async with serving(tiny_model, adapters, allow=False) as (fe, workers, client, raw):
            models = (await client.models.list()).data
            assert [(m.id, getattr(m, "parent", None)) for m in models] == [
                (fe.info.model, None),
                ("alpha", fe.info.model),
                ("beta", fe.info.model),
            ]
            for name in (None, "alpha", "beta"):
                r = await _complete(client, name or fe.info.model)
                assert r.model == (name or fe.info.model)
                assert r.choices[0].text == fe.tokenizer.decode(offline[name]), name
            stream = await _complete(client, "beta", stream=True)
            assert "".join([c.choices[0].text async for c in stream if c.choices]) == fe.tokenizer.decode(
                offline["beta"]
            )
            # An unknown name is a 404 that names it.
            with pytest.raises(openai.NotFoundError, match="'delta'"):
                await _complete(client, "delta")
            # vLLM's /tokenize takes the adapter's name too.
            tok = await _post(raw, "/tokenize", {"model": "alpha", "prompt": "hello"})
            assert tok.status_code == 200, tok.text
            # Runtime updates need --allow-runtime-lora-updating: 403, and nothing changes.
            r = await _post(raw, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": adapters["gamma"]})
            assert r.status_code == 403 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
            r = await _post(raw, "/v1/unload_lora_adapter", {"lora_name": "alpha"})
            assert r.status_code == 403
            assert all(set(w.engine.engine.lora_by_name) == {"alpha", "beta"} for w in workers)
            # The static adapters' ids are derived alike on every worker.
            assert all(
                w.engine.engine.lora_by_name["alpha"].lora_int_id == stable_lora_id("alpha", adapters["alpha"])
                for w in workers
            )

    asyncio.run(main())


def test_runtime_load_and_unload(tiny_model, adapters, offline):
    async def main():
        async with serving(tiny_model, adapters) as (fe, workers, client, raw):
            body = {"lora_name": "gamma", "lora_path": adapters["gamma"]}
            assert (await _post(raw, "/v1/load_lora_adapter", body, key=None)).status_code == 401
            r = await _post(raw, "/v1/load_lora_adapter", body)
            assert r.status_code == 200, r.text
            assert "gamma" in {m.id for m in (await client.models.list()).data}
            ids = {w.engine.engine.lora_by_name["gamma"].lora_int_id for w in workers}
            assert len(ids) == 1 and ids != {stable_lora_id("gamma", adapters["gamma"])}  # one fresh id, everywhere
            assert (await _complete(client, "gamma")).choices[0].text == fe.tokenizer.decode(offline["gamma"])
            # Loaded already: 409. A bad adapter: 400, and no worker keeps it.
            assert (await _post(raw, "/v1/load_lora_adapter", body)).status_code == 409
            bad = {"lora_name": "broken", "lora_path": tiny_model}  # a model folder, not an adapter
            r = await _post(raw, "/v1/load_lora_adapter", bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
            r = await _post(raw, "/v1/load_lora_adapter", {"lora_name": "", "lora_path": "x"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
            r = await _post(raw, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": ["/etc"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
            r = await _post(raw, "/v1/load_lora_adapter", {"lora_name": "n" * 300, "lora_path": adapters["gamma"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
            assert all("broken" not in w.engine.engine.lora_by_name for w in workers)
            # In use: 409 until its request ends (here: until its stream is closed); it serves on meanwhile.
            held = await _hold(fe, "gamma")
            r = await _post(raw, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
            assert r.status_code == 409 and "in use" in r.json()["error"]["message"], r.text
            assert all("gamma" in w.engine.engine.lora_by_name for w in workers)
            await held.aclose()
            for _ in range(2000):  # its abort lands in the engine at the next step
                if not any(w.engine.engine.requests for w in workers):
                    break
                await asyncio.sleep(0.01)
            r = await _post(raw, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
            assert r.status_code == 200, r.text
            assert "gamma" not in {m.id for m in (await client.models.list()).data}
            with pytest.raises(openai.NotFoundError):
                await _complete(client, "gamma")
            r = await _post(raw, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
            assert r.status_code == 404
            # Reloaded, it serves again (under another fresh id).
            assert (await _post(raw, "/v1/load_lora_adapter", body)).status_code == 200
            assert {w.engine.engine.lora_by_name["gamma"].lora_int_id for w in workers}.isdisjoint(ids)
            assert (await _complete(client, "gamma")).choices[0].text == fe.tokenizer.decode(offline["gamma"])

    asyncio.run(main())


def test_workers_started_later_serve_the_runtime_adapters(tiny_model, adapters, offline):
    """A runtime load lands in the application's registry: a worker started
    after it loads it at start; one that started while it was being loaded
    (outside the broadcast) loads it on its first request under it; an
    unload takes it out again, and a registered adapter that cannot be read
    at a worker's start leaves that worker up without it."""

    async def tokens(worker, lora_name: str, rid: str) -> list[int] | WorkerError:
        params = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
        out = [m async for m in worker.generate(GenerateRequest(rid, PROMPT, params, lora_name=lora_name))]
        if isinstance(out[0], WorkerError):
            return out[0]
        return [t for m in out for t in m.token_ids]

    async def main():
        async with serving(tiny_model, adapters) as (fe, workers, client, raw):
            registry = fe.lora.registry
            args = _engine_args(tiny_model, adapters)
            between = Worker(args, max_waiting=64, lora_registry=registry)  # not in the pool: no broadcast reaches it
            later = None
            try:
                body = {"lora_name": "gamma", "lora_path": adapters["gamma"]}
                assert (await _post(raw, "/v1/load_lora_adapter", body)).status_code == 200
                lora_id = workers[0].engine.engine.lora_by_name["gamma"].lora_int_id
                assert registry.entries() == {"gamma": RuntimeLoRA(adapters["gamma"], lora_id)}
                later = Worker(args, max_waiting=64, lora_registry=registry)
                assert later.engine.engine.lora_by_name["gamma"].lora_int_id == lora_id
                assert later.info().loras["gamma"] == lora_id  # what routers read
                assert await tokens(later, "gamma", "g1") == offline["gamma"]
                assert "gamma" not in between.engine.engine.lora_by_name
                # Two requests at once: one load, both served.
                both = await asyncio.gather(tokens(between, "gamma", "g2"), tokens(between, "gamma", "g3"))
                assert both == [offline["gamma"]] * 2
                assert between.engine.engine.lora_by_name["gamma"].lora_int_id == lora_id
                # A load the broadcast brings to a worker that took it up from the registry already: no conflict.
                assert await between.load_lora_adapter("gamma", adapters["gamma"], lora_id) is None
                # The in-use check passes, then a worker refuses (a request landed between): it stays registered.
                held = await _hold(fe, "gamma")
                pool_broadcast = fe.pool.broadcast

                async def broadcast(method, *a):
                    return [0] * len(workers) if method == "num_lora_requests" else await pool_broadcast(method, *a)

                fe.pool.broadcast = broadcast
                r = await _post(raw, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
                assert r.status_code == 409, r.text
                assert registry.get("gamma") == RuntimeLoRA(adapters["gamma"], lora_id)
                fe.pool.broadcast = pool_broadcast
                await held.aclose()
                for _ in range(2000):  # its abort lands in the engine at the next step
                    if not any(w.engine.engine.requests for w in workers):
                        break
                    await asyncio.sleep(0.01)
                assert (await _post(raw, "/v1/unload_lora_adapter", {"lora_name": "gamma"})).status_code == 200
                assert registry.entries() == {}
                assert await tokens(between, "beta", "b1") == offline["beta"]  # (--lora-modules: its own)
            finally:
                for w in (between, later):
                    if w is not None:
                        await w.engine.shutdown()
            # Unloaded: a worker started now does not serve it; an unreadable entry leaves a worker up without it.
            registry.add("ghost", RuntimeLoRA("/nonexistent/adapter", 77))
            after = Worker(args, max_waiting=64, lora_registry=registry)
            try:
                assert set(after.engine.engine.lora_by_name) == {"alpha", "beta"}
                err = await tokens(after, "ghost", "x1")
                assert isinstance(err, WorkerError) and err.kind == "not_found" and "'ghost'" in err.message
                assert await tokens(after, "alpha", "a1") == offline["alpha"]
            finally:
                await after.engine.shutdown()

    asyncio.run(main())


def test_grpc_lora_and_model_info(tiny_model, adapters, offline):
    async def main():
        async with serving(tiny_model, adapters, num_workers=1) as (fe, workers, client, raw):
            fe.api_key = None  # the gRPC helper's channel sends no key
            async with grpc_server(fe) as addr, grpc.aio.insecure_channel(addr) as ch:
                stub = shoal_pb2_grpc.ShoalStub(ch)
                info = await stub.GetModelInfo(pb.GetModelInfoRequest())
                sampling = pb.SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True)
                got = {}
                for name in ("", "alpha", "beta"):
                    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=sampling, lora=name)
                    got[name or None] = [t async for m in stub.Generate(req) for t in m.token_ids]
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=sampling, lora="nope")
                    [m async for m in stub.Generate(req)]
                assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in e.value.details()
        return info, got

    info, got = asyncio.run(main())
    assert [(a.name, a.parent) for a in info.lora_adapters] == [("alpha", info.model), ("beta", info.model)]
    assert info.max_loras == 1
    assert got == {k: offline[k] for k in (None, "alpha", "beta")}


def test_metrics_status_and_worker_report(tiny_model, adapters, monkeypatch):
    from shoal.proto import tracing as worker_tracing

    seen = []
    real = worker_tracing.start_worker_span
    monkeypatch.setattr(
        worker_tracing, "start_worker_span", lambda ctx, rid, attrs=None: seen.append(attrs) or real(ctx, rid, attrs)
    )

    async def main():
        async with serving(tiny_model, adapters, num_workers=1) as (fe, workers, client, raw):
            await _complete(client, "alpha")
            w = workers[0]
            load = w.stats()
            # In the slot / in host memory (its tensors kept from the load: --max-cpu-loras 2).
            assert load.loras["alpha"][1] == 2 and load.loras["beta"][1] == 1
            # A worker refuses a name it does not serve, whatever the router thought.
            req = GenerateRequest("x1", PROMPT, SamplingParams(max_tokens=2), lora_name="nope")
            (err,) = [m async for m in w.generate(req)]
            assert isinstance(err, WorkerError) and err.kind == "not_found" and "'nope'" in err.message
            # Held running (the engine stalled after its first token): the gauge and the status page show it.
            held = await _hold(fe, "beta")
            w.engine.stall(600)  # ended by the shutdown below
            metrics = (await raw.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})).text
            status = (await raw.get("/api/status", headers={"Authorization": f"Bearer {KEY}"})).json()
            await held.aclose()
        return metrics, status

    metrics, status = asyncio.run(main())
    (line,) = [x for x in metrics.splitlines() if x.startswith("shoal:lora_requests_info{")]
    # Counts, not names, without --metrics-include-lora-names (/metrics answers without the key).
    assert 'running_lora_adapters="1"' in line and 'waiting_lora_adapters="0"' in line and 'max_lora="1"' in line
    assert "beta" not in metrics
    (worker,) = status["workers"]
    assert worker["lora_on_device"] == ["beta"] and worker["running_lora_adapters"] == ["beta"]
    assert status["max_loras"] == 1
    assert {"gen_ai.request.model": "alpha", "shoal.lora": stable_lora_id("alpha", adapters["alpha"])}.items() <= (
        seen[0].items()
    )


async def _tokens(worker, lora_name: str | None, rid: str) -> list[int] | WorkerError:
    params = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    out = [m async for m in worker.generate(GenerateRequest(rid, PROMPT, params, lora_name=lora_name))]
    if isinstance(out[0], WorkerError):
        return out[0]
    return [t for m in out for t in m.token_ids]


def test_an_adapter_changed_on_disk_never_reaches_a_worker(tiny_model, adapters, offline, tmp_path):
    """Loaded at run time, then its weights overwritten with garbage: the
    worker that loaded it serves it from the tensors it checked, token for
    token; a worker started afterwards comes up, reports it unavailable (and
    refuses it), serves the rest; the router sends the adapter's requests to
    the worker that has it, the base model's to either. Once evicted from
    host memory, the adapter is refused where it was served, alone."""
    path = shutil.copytree(adapters["gamma"], tmp_path / "gamma")

    async def main():
        async with serving(tiny_model, adapters, num_workers=1) as (fe, (first,), client, raw):
            r = await _post(raw, "/v1/load_lora_adapter", {"lora_name": "g", "lora_path": str(path)})
            assert r.status_code == 200, r.text
            lora_id = first.engine.engine.lora_by_name["g"].lora_int_id
            (path / "adapter_model.safetensors").write_bytes(b"not safetensors " * 64)
            assert (await _complete(client, "g")).choices[0].text == fe.tokenizer.decode(offline["gamma"])
            later = Worker(_engine_args(tiny_model, adapters), max_waiting=64, lora_registry=fe.lora.registry)
            try:
                assert later.stats().loras["g"] == (lora_id, LORA_UNAVAILABLE)
                assert later.info().loras["g"] == lora_id  # served by the application, if not here
                err = await _tokens(later, "g", "direct")
                assert isinstance(err, WorkerError) and err.kind == "not_found" and "not available" in err.message
                assert await _tokens(later, "alpha", "a1") == offline["alpha"]
                pool = LocalWorkerPool([later, first])  # `later` first: ties would go to it
                served = []
                for i in range(4):
                    for lora in ("g", None):
                        params = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
                        out = [
                            m
                            async for m in pool.generate(GenerateRequest(f"p{i}{lora}", PROMPT, params, lora_name=lora))
                        ]
                        assert not isinstance(out[0], WorkerError), out[0]
                        assert [t for m in out for t in m.token_ids] == offline["gamma" if lora else None]
                        served.append((lora, out[-1].finished.worker))
                assert {w for lora, w in served if lora == "g"} == {first.name}
                # Pushed out of host memory by two others (--max-cpu-loras 2), it is read again on its next
                # request, outside any step: that request alone is refused (400), and the adapter is out here.
                assert await _tokens(first, "alpha", "e1") == offline["alpha"]
                assert await _tokens(first, "beta", "e2") == offline["beta"]
                assert lora_id not in first.engine.engine.lora_host.ids()
                err = await _tokens(first, "g", "e3")
                assert isinstance(err, WorkerError) and err.kind == "invalid" and "cannot be loaded" in err.message
                assert first.stats().loras["g"] == (lora_id, LORA_UNAVAILABLE)
                assert (await _tokens(first, "g", "e4")).kind == "not_found"
                assert await _tokens(first, None, "e5") == offline[None]
                assert first.engine.failed is None
            finally:
                await later.engine.shutdown()

    asyncio.run(main())


def test_lora_root_refuses_paths_outside_it_alike(tiny_model, adapters, tmp_path):
    """--lora-root: a runtime load from outside it (directly, through `..`, or
    through a symlink, of the folder or of a file in it) is 403 at the router
    and at each worker; missing and existing paths outside, and missing or
    unreadable ones inside, get one message, which names neither."""
    root, away = tmp_path / "root", tmp_path / "away"
    root.mkdir()
    inside = shutil.copytree(adapters["gamma"], root / "g")
    outside = shutil.copytree(adapters["gamma"], away / "g")
    (root / "link").symlink_to(outside)
    (root / "files").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "files" / name).symlink_to(outside / name)
    (root / "junk").mkdir()
    (root / "junk" / "adapter_config.json").write_text('{"r": 4}')
    (root / "junk" / "adapter_model.safetensors").write_bytes(b"junk")

    async def main():
        async with serving(tiny_model, adapters, num_workers=1, lora_root=str(root)) as (fe, (w,), client, raw):

            async def load(name, path):
                r = await _post(raw, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
                return r.status_code, r.json()["error"]["message"] if r.status_code != 200 else ""

            assert await load("in", str(inside)) == (200, "")
            assert await load("rel", "g") == (200, "")  # relative: under the root
            said = set()
            for i, path in enumerate(
                (str(outside), str(away / "nowhere"), f"{root}/../away/g", str(root / "link"), "../away/g")
            ):
                status, message = await load(f"out{i}", path)
                assert status == 403, (path, message)
                said.add(message.replace(f"'out{i}'", "NAME"))
            status, message = await load("files", str(root / "files"))  # only the worker sees where its files lead
            assert status == 403
            said.add(message.replace("'files'", "NAME"))
            for name, path in (("missing", str(root / "nothing")), ("junk", str(root / "junk"))):
                status, message = await load(name, path)
                assert status == 400, (path, message)
                said.add(message.replace(f"'{name}'", "NAME"))
            assert len(said) == 1 and "nowhere" not in said.pop()
            # The worker checks by itself too.
            err = await w.load_lora_adapter("direct", str(root / "link"), 1234)
            assert isinstance(err, WorkerError) and err.kind == "forbidden"
            assert set(w.engine.engine.lora_by_name) == {"alpha", "beta", "in", "rel"}
            assert (await _complete(client, "in")).choices[0].text == (await _complete(client, "rel")).choices[0].text

    asyncio.run(main())


def test_max_runtime_loras_caps_the_runtime_loads(tiny_model, adapters):
    async def main():
        async with serving(tiny_model, adapters, num_workers=1, max_runtime_loras=1) as (fe, (w,), client, raw):
            body = {"lora_name": "gamma", "lora_path": adapters["gamma"]}
            assert (await _post(raw, "/v1/load_lora_adapter", body)).status_code == 200
            r = await _post(raw, "/v1/load_lora_adapter", {"lora_name": "g2", "lora_path": adapters["gamma"]})
            assert r.status_code == 409 and "--max-runtime-loras" in r.json()["error"]["message"], r.text
            assert r.json()["error"]["code"] == "lora_limit"
            # The worker holds to it by itself; --lora-modules' adapters do not count.
            err = await w.load_lora_adapter("g3", adapters["gamma"], 4321)
            assert isinstance(err, WorkerError) and err.kind == "conflict" and err.code == "lora_limit"
            assert (await _post(raw, "/v1/unload_lora_adapter", {"lora_name": "gamma"})).status_code == 200
            r = await _post(raw, "/v1/load_lora_adapter", {"lora_name": "g2", "lora_path": adapters["gamma"]})
            assert r.status_code == 200, r.text

    asyncio.run(main())


def test_lora_requests_info_names_adapters_only_when_asked():
    from shoal.proto.messages import WorkerLoad
    from shoal.router.observability.metrics import RouterMetrics

    load = WorkerLoad(1, 1, 10, 10, 0.0, 0, 0, 0, 0, 0, 0, 0, worker="w0", time=1.0)
    load.running_lora_adapters, load.waiting_lora_adapters = ("alpha", "beta"), ("secret-tenant",)
    for names, labels in (
        (False, 'running_lora_adapters="2",waiting_lora_adapters="1"'),
        (True, 'running_lora_adapters="alpha,beta",waiting_lora_adapters="secret-tenant"'),
    ):
        text = RouterMetrics("m", 64, 2, include_lora_names=names).render([load]).decode()
        (line,) = [x for x in text.splitlines() if x.startswith("shoal:lora_requests_info{")]
        assert labels in line
        assert ("secret-tenant" in text) is names


ROUTER_SPAN = textwrap.dedent("""
    from shoal.router.fronts.frontend import Frontend, ModelInfo
    from shoal.router.observability import tracing as rt

    assert rt.configure("shoal-router")
    info = ModelInfo("base-model", 64, 100, 16, 1, 1, enable_lora=True, max_loras=2, loras={"alpha": 12345})
    fe = Frontend(None, None, info)
    span = fe.start_span(None, "chat", "chatcmpl-9", None, False, "alpha")
    rt.end_request_span(span)
    assert rt.flush(10)
""")


def test_the_router_span_names_the_adapter():
    with OtlpCollector() as collector:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = collector.endpoint
        proc = subprocess.run([sys.executable, "-c", ROUTER_SPAN], env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        span = collector.wait_for(lambda s: s.name == "chat alpha")
    assert span.attributes["gen_ai.request.model"] == "alpha" and span.attributes["shoal.lora"] == 12345


def test_lora_modules_flags():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(
        [
            "--lora-modules",
            "a=/x/a",
            '{"name": "b", "path": "/x/b", "base_model_name": "m"}',
            "--lora-modules",
            "c=/x/c",
        ]
    )
    mods = parse_lora_modules(EngineArgs.from_cli_args(ns).lora_modules)
    assert [(m.name, m.path, m.base_model_name) for m in mods] == [
        ("a", "/x/a", None),
        ("b", "/x/b", "m"),
        ("c", "/x/c", None),
    ]
    # A Serve config or Helm values may give the objects themselves.
    assert parse_lora_modules([{"name": "d", "path": "/x/d"}])[0].path == "/x/d"
    for bad, words in (
        (["nopath"], "not name=path"),
        (["=p"], "non-empty"),
        (["a=/x", "a=/y"], "given twice"),
        (['{"name": "a"}'], "needs a path"),
        (['{"name": "a", "path": "/x", "rank": 4}'], "unknown key 'rank'"),
        (["{not json"], "not valid JSON"),
    ):
        with pytest.raises(ValueError, match=words):
            parse_lora_modules(bad)


def test_a_bad_lora_module_fails_the_start_naming_it(tiny_model, adapters):
    from shoal.workers.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="adapter 'oops'"):
        LLMEngine(EngineArgs(model=tiny_model, enable_lora=True, num_threads=1, lora_modules=[f"oops={tiny_model}"]))
    with pytest.raises(ValueError, match="enable-lora"):
        LLMEngine(EngineArgs(model=tiny_model, num_threads=1, lora_modules=[f"alpha={adapters['alpha']}"]))
    with pytest.raises(ValueError, match="allow_runtime_lora_updating needs enable_lora"):
        ServeOptions(allow_runtime_lora_updating=True).validate()

"""Cache isolation: a request's cache_salt (vLLM's field) salts the root of
its prefix-cache chain in the router and in the engine alike, so requests
with different salts share no KV block and `cached_tokens` never reports
another salt's prefix; --cache-isolation key folds the caller's API-key
identity into every salt. Counted in the engine: its prefix-cache hits."""

from __future__ import annotations

import asyncio
import hashlib
from contextlib import AsyncExitStack

import grpc
import pytest
from serving import grpc_server, http_client
from test_block_hash import BS, run_to_end, seq_of

from shoal.cluster.options import ServeOptions
from shoal.proto.block_hash import (
    MAX_CACHE_SALT_CHARS,
    chain_hashes,
    check_cache_salt,
    hash_block,
    root_key,
)
from shoal.proto.errors import InvalidRequestError
from shoal.proto.messages import GenerateRequest, WorkerError
from shoal.proto.sampling_params import SamplingParams
from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.router.fronts.cache_isolation import CacheIsolation, resolve_mode
from shoal.router.fronts.frontend import Frontend, ModelInfo
from shoal.router.routing.worker_pool import LocalWorkerPool
from shoal.workers import EngineArgs
from shoal.workers.core.block_manager import BlockManager
from shoal.workers.worker import Worker

PROMPT = list(range(10, 74))  # 64 token ids: 4 blocks of 16, of which a repeat may reuse 3 (the last token is computed)
REUSABLE = 48


# ---- the keys -----------------------------------------------------------------


def test_a_salt_changes_the_root_and_so_every_key():
    ids = list(range(40))
    plain, a, b = chain_hashes(ids, BS), chain_hashes(ids, BS, cache_salt="a"), chain_hashes(ids, BS, cache_salt="b")
    assert len(plain) == len(a) == len(b) == 10
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)
    assert chain_hashes(ids, BS, cache_salt="a") == a  # deterministic: router and workers agree
    # Written out: the first block's parent is SHA-256 of the salted constant, the block size and the salt.
    root = hashlib.sha256(b"shoal.prefix-cache.sha256.v1.salted" + BS.to_bytes(4, "little") + b"a").digest()
    assert root_key(BS, "a") == root and root_key(BS, None) == root_key(BS) != root
    assert a[0] == hash_block(None, ids[:BS], cache_salt="a") == hash_block(root, ids[:BS])
    assert a[1] == hash_block(a[0], ids[BS : 2 * BS])  # only the root is salted; the chain carries it
    # Extending a salted chain needs no salt: it goes on from its last key.
    assert chain_hashes(ids, BS, start=a[:3]) == a
    # Composes with the adapter's salt of every block.
    assert chain_hashes(ids, BS, extra=b"lora:1", cache_salt="a") != a != chain_hashes(ids, BS, extra=b"lora:1")


@pytest.mark.parametrize(
    "bad, word",
    [
        ("", "non-empty"),
        ("x" * (MAX_CACHE_SALT_CHARS + 1), "at most"),
        (5, "string"),
        (["a"], "string"),
        ("\ud800", "Unicode"),
    ],
)
def test_a_bad_salt_is_refused_with_the_field(bad, word):
    with pytest.raises(InvalidRequestError) as e:
        check_cache_salt(bad)
    assert e.value.field == "cache_salt" and word in str(e.value)
    check_cache_salt(None)
    check_cache_salt("x" * MAX_CACHE_SALT_CHARS)
    check_cache_salt("ünïcode ✓")


def test_the_block_manager_shares_blocks_only_within_a_salt():
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    toks = list(range(1, 14))  # 3 full blocks, 3 reusable

    def salted(rid: str, salt: str | None):
        s = seq_of(rid, toks)
        s.cache_salt = salt
        return s

    run_to_end(bm, salted("a", "alice"))
    assert bm.get_computed_blocks(salted("b", "bob")) == []
    assert bm.get_computed_blocks(salted("c", None)) == []
    assert len(bm.get_computed_blocks(salted("d", "alice"))) == 3
    # A parallel-sampling sibling takes its donor's blocks only under the same salt.
    donor = salted("e", "alice")
    run_to_end(BlockManager(64, BS, enable_prefix_caching=False), donor)
    donor.block_table = [1, 2, 3, 4]
    assert bm.shared_blocks(salted("f", "alice"), donor, len(toks)) == [1, 2, 3]
    assert bm.shared_blocks(salted("g", "bob"), donor, len(toks)) == []


def test_isolation_modes_and_the_salt_they_make():
    assert (
        resolve_mode(None, "k") == "key" and resolve_mode(None, None) == "none" and resolve_mode("none", "k") == "none"
    )
    with pytest.raises(ValueError):
        resolve_mode("tenant", "k")
    a, a2, b = (
        CacheIsolation.build(None, "key-a"),
        CacheIsolation.build("key", "key-a"),
        CacheIsolation.build(None, "key-b"),
    )
    assert a.salt(None) == a2.salt(None) != b.salt(None)
    assert a.salt("s") != a.salt(None) and a.salt("s") != b.salt("s") and a.salt("s") != "s"
    assert "key-a" not in a.salt(None) and len(a.salt("x" * MAX_CACHE_SALT_CHARS)) <= MAX_CACHE_SALT_CHARS
    check_cache_salt(a.salt("s"))  # what it makes passes the engine's check
    off = CacheIsolation.build("none", "key-a")
    assert off.salt(None) is None and off.salt("s") == "s"
    # A later per-caller identity (several keys, tenants) goes in as `caller`.
    assert a.salt(None, CacheIsolation.identity("key-b")) == b.salt(None)
    assert ServeOptions().cache_isolation is None and ServeOptions().router_options().cache_isolation is None


# ---- through the fronts, counted in the engine -----------------------------


def _worker(tiny_model) -> Worker:
    return Worker(EngineArgs(model=tiny_model, num_kv_blocks=64, num_threads=1), max_waiting=8)


def _frontend(worker: Worker, api_key: str | None = None, cache_isolation: str | None = None) -> Frontend:
    info = ModelInfo.from_worker_info(worker.info(), 1)
    return Frontend(
        LocalWorkerPool([worker]), worker.engine.engine.tokenizer, info, api_key, cache_isolation=cache_isolation
    )


def _hits(worker: Worker) -> int:
    """Prompt tokens the engine has served from its prefix cache."""
    return worker.engine.engine.block_manager.pool.num_hit_tokens


def _body(salt=None) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    return body if salt is None else body | {"cache_salt": salt}


async def _cached(client, salt=None, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    r = await client.post("/v1/completions", json=_body(salt), headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_http_cache_salt_keeps_prefixes_apart_and_router_and_engine_agree(tiny_model, monkeypatch):
    sent: list[GenerateRequest] = []
    real = LocalWorkerPool.generate
    monkeypatch.setattr(LocalWorkerPool, "generate", lambda self, req: sent.append(req) or real(self, req))

    async def main():
        worker = _worker(tiny_model)
        try:
            async with http_client(_frontend(worker)) as client:
                counts = []
                for salt in ("alice", "bob", "alice"):
                    before = _hits(worker)
                    cached = await _cached(client, salt)
                    counts.append((cached, _hits(worker) - before))
                # The engine computes the salted chain itself (no router keys given): it hits the router's.
                direct = GenerateRequest(
                    "direct", PROMPT, SamplingParams(max_tokens=1, ignore_eos=True), cache_salt="bob"
                )
                before = _hits(worker)
                out = [d async for d in worker.generate(direct)]
                engine_hits = _hits(worker) - before
                before = _hits(worker)
                counts.append((await _cached(client, None), _hits(worker) - before))  # unsalted: none of theirs
                cached_keys = {b.block_hash for b in worker.engine.engine.block_manager.pool.blocks}
                bad = [
                    await client.post("/v1/completions", json=_body(s))
                    for s in ("x" * (MAX_CACHE_SALT_CHARS + 1), 7, "", {"a": 1})
                ]
                chat = await client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": ["no"]},
                )
        finally:
            await worker.engine.shutdown()
        return counts, bad, chat, out, engine_hits, cached_keys

    counts, bad, chat, out, engine_hits, cached_keys = asyncio.run(main())
    # alice first; bob gets nothing of hers; alice again gets her own prefix; an unsalted caller nothing.
    assert counts == [(0, 0), (0, 0), (REUSABLE, REUSABLE), (0, 0)]
    for r in bad + [chat]:
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    assert out[-1].finished is not None and out[-1].finished.num_cached_tokens == REUSABLE == engine_hits
    # The router's affinity chain is the engine's chain for the salted prompt, and the keys the engine cached.
    first = sent[0]
    assert first.cache_salt == "alice" and first.block_hashes == chain_hashes(PROMPT, 16, cache_salt="alice")
    assert set(first.block_hashes) <= cached_keys
    assert sent[-1].cache_salt is None and sent[-1].block_hashes == chain_hashes(PROMPT, 16)


def test_grpc_cache_salt_works_the_same(tiny_model):
    def req(salt: str) -> pb.GenerateRequest:
        sp = pb.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=sp, cache_salt=salt)

    async def main():
        worker = _worker(tiny_model)
        try:
            async with grpc_server(_frontend(worker)) as addr, grpc.aio.insecure_channel(addr) as ch:
                stub = shoal_pb2_grpc.ShoalStub(ch)
                cached = []
                for salt in ("alice", "bob", "alice", ""):
                    msgs = [m async for m in stub.Generate(req(salt))]
                    cached.append(msgs[-1].finished.usage.cached_tokens)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    _ = [m async for m in stub.Generate(req("x" * (MAX_CACHE_SALT_CHARS + 1)))]
        finally:
            await worker.engine.shutdown()
        return cached, e.value

    cached, err = asyncio.run(main())
    assert cached == [0, 0, REUSABLE, 0]  # empty is unset (proto3): not alice's
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in err.details()


def test_the_engine_refuses_a_bad_salt_that_bypassed_the_front(tiny_model):
    async def main():
        worker = _worker(tiny_model)
        try:
            refused = []
            for i, salt in enumerate(("x" * (MAX_CACHE_SALT_CHARS + 1), 5, b"bytes", "")):
                req = GenerateRequest(f"bad-{i}", PROMPT, SamplingParams(max_tokens=1), cache_salt=salt)
                refused.append([d async for d in worker.generate(req)])
            good = [d async for d in worker.generate(GenerateRequest("good", PROMPT, SamplingParams(max_tokens=1)))]
            with pytest.raises(InvalidRequestError):  # the offline engine too
                worker.engine.engine.add_request(
                    GenerateRequest(
                        "bad-offline", worker.engine.engine.tokenize(PROMPT), SamplingParams(), cache_salt=3
                    )
                )
        finally:
            await worker.engine.shutdown()
        return refused, good

    refused, good = asyncio.run(main())
    for msgs in refused:
        assert len(msgs) == 1 and isinstance(msgs[0], WorkerError)
        assert msgs[0].kind == "invalid" and msgs[0].field == "cache_salt"
    assert good[-1].finished is not None and good[-1].finished.finish_reason == "length"


def test_key_isolation_salts_by_the_callers_key(tiny_model):
    """Routers with different API keys over one engine share no block; with
    the same key they do; --cache-isolation none shares across keys; and a
    client's cache_salt still splits one key's callers."""

    async def main():
        worker = _worker(tiny_model)
        try:
            async with AsyncExitStack() as stack:

                async def client(key, mode=None):
                    return await stack.enter_async_context(http_client(_frontend(worker, key, mode)))

                a, b, a2 = await client("key-a"), await client("key-b"), await client("key-a")
                open_a, open_b = await client("key-a", "none"), await client("key-b", "none")
                steps = []
                for c, key, salt in (
                    (a, "key-a", None),
                    (b, "key-b", None),  # another key: nothing of a's
                    (a2, "key-a", None),  # another router, the same key: a's prefix
                    (a, "key-a", "s"),  # the same key, a client salt: apart
                    (open_a, "key-a", None),  # mode none: unsalted, a fresh chain ...
                    (open_b, "key-b", None),  # ... which another key's caller shares
                ):
                    before = _hits(worker)
                    steps.append((await _cached(c, salt, key), _hits(worker) - before))
        finally:
            await worker.engine.shutdown()
        return steps

    steps = asyncio.run(main())
    assert steps == [(0, 0), (0, 0), (REUSABLE, REUSABLE), (0, 0), (0, 0), (REUSABLE, REUSABLE)]

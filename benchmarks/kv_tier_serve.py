"""`shoal bench kv-tier --serve`: the agent conversations on real workers, as
`shoal serve` deploys them (build_app), in a local Ray cluster: two worker
replicas (each its own process and paged cache), the router choosing by
each routing policy in turn, the cluster tier off and on. Requests go over
gRPC, as token ids, one at a time, the conversations interleaved in a seeded
random order (agent_workload.shuffled); each turn's TTFT is the client's
(send to first token), its hits the worker's cached_tokens, and its worker
the one the final message names.

Each configuration deploys the application afresh (empty caches, an empty
cluster tier) and deletes it after; the Ray cluster is shared.
"""

from __future__ import annotations

import os
import time

from shoal.benchmarks.agent_workload import AgentWorkload, Conversation, make_conversations, shuffled, summarize
from shoal.benchmarks.ports import free_port
from shoal.benchmarks.routing import QUIET, RAY_QUIET
from shoal.workers.engine_args import EngineArgs

APP = "shoal-bench-kv-tier"


def _generate(stub, ids: list[int], max_tokens: int) -> dict:
    from shoal.proto.v1 import shoal_pb2 as pb

    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sampling)
    t0, ttft, tokens, done = time.perf_counter(), None, [], None
    for m in stub.Generate(request, timeout=600):
        if m.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        tokens += m.token_ids
        if m.HasField("finished"):
            done = m.finished
    assert done is not None and ttft is not None, "the stream ended without a finished message"
    return {"ttft_s": ttft, "cached": done.usage.cached_tokens, "ids": tokens, "worker": done.worker}


def _conversations(addr: str, w: AgentWorkload, vocab: int, block_size: int) -> tuple[dict, list[Conversation]]:
    import grpc

    from shoal.proto.v1 import shoal_pb2_grpc as pb_grpc

    convs = make_conversations(w, vocab)
    rows, seen_system, last_worker, moved = [], False, {}, 0
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.ShoalStub(channel)
        for k in range(4):  # warm-up: prompts sharing no block with the workload, to every worker
            _generate(stub, [(k * 7919 + i) % (vocab - 3) + 3 for i in range(40)], 2)
        t0 = time.perf_counter()
        for conv, t in shuffled(convs, w.seed + 4):
            user, reply = conv.turns[t]
            prompt = conv.context + user
            ideal = conv.reused if (t or seen_system) else 0
            ideal = min(ideal // block_size, (len(prompt) - 1) // block_size) * block_size
            r = _generate(stub, prompt, reply)
            moved += t > 0 and last_worker[id(conv)] != r["worker"]
            last_worker[id(conv)] = r["worker"]
            seen_system = True
            conv.context = prompt + r["ids"]
            conv.reused = len(conv.context) - 1
            rows.append(
                {"turn": t, "prompt": len(prompt), "ideal": ideal, "ttft_s": r["ttft_s"], "cached": r["cached"]}
            )
        seconds = time.perf_counter() - t0
    return summarize(rows, convs, seconds, moved), convs


def _tier_costs(handle, workers: int) -> dict:
    """What the workers measured: ms a block loaded from each tier took, and
    ms a token of prefill (their mean), from their stats (a broadcast)."""
    loads = handle.broadcast("stats").results(timeout_s=60)
    assert len(loads) == workers, f"{len(loads)} of {workers} workers answered"
    tiers: dict[str, list[int]] = {}
    for load in loads:
        for tier, t in load.kv_tiers.items():
            into = tiers.setdefault(tier, [0, 0, 0])
            into[0] += t["load_us"]
            into[1] += t["loaded_blocks"]
            into[2] += t["hit_tokens"]
    return {
        "fetch_ms_per_block": {tier: us / n / 1000 for tier, (us, n, _) in tiers.items() if n},
        "tier_hit_tokens": {tier: hits for tier, (_, _, hits) in tiers.items()},
        "prefill_ms_per_token": sum(x.prefill_us_per_token for x in loads) / len(loads) / 1000,
    }


def serve_runs(
    args: EngineArgs, w: AgentWorkload, vocab: int, workers: int, cluster_bytes: int, policies: list[str]
) -> dict[str, dict]:
    """Every (routing policy, cluster tier off/on) configuration on `workers`
    real workers: name -> the run's figures (as kv_tier._conversation_run's)."""
    from shoal.router.routing.policies import POLICY_NAMES

    for p in policies:
        if p not in POLICY_NAMES:
            raise SystemExit(f"--serve-routing: {p!r} is not a policy ({', '.join(POLICY_NAMES)})")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from shoal.cluster.app import build_app

    threads = os.cpu_count() or 1  # one request at a time: the worker computing has every core
    ray.init(address="local", num_cpus=max(threads, workers + 1), num_gpus=0, **RAY_QUIET)
    runs: dict[str, dict] = {}
    try:
        serve.start(proxy_location="Disabled", logging_config=QUIET)
        for policy in policies:
            for tier in (None, "object-store"):
                name = f"{workers} workers {policy}, " + ("cluster tier" if tier else "tiers off")
                grpc_port = free_port()
                opts = dict(
                    model=args.model,
                    num_workers=workers,
                    num_threads=threads,
                    num_kv_blocks=args.num_kv_blocks,
                    block_size=args.block_size,
                    routing=policy,
                    kv_cluster_tier=tier,
                    kv_cluster_bytes=cluster_bytes,
                    http_port=free_port(),
                    grpc_port=grpc_port,
                )
                t0 = time.perf_counter()
                serve.run(build_app(opts), name=APP, route_prefix=None, logging_config=QUIET)
                try:
                    runs[name], _ = _conversations(f"127.0.0.1:{grpc_port}", w, vocab, args.block_size)
                    runs[name].update(_tier_costs(serve.get_deployment_handle("Worker", APP), workers))
                finally:
                    serve.delete(APP)
                r = runs[name]
                print(
                    f"  {name:32s} {r['seconds']:8.1f} {r['output_tok_s']:10.1f} {r['hit_share_of_ideal']:12.1%} "
                    f"{1000 * r['ttft_p50_later_turns_s']:19.0f} ms  ({r['moved_turn_share']:.0%} of later turns "
                    f"moved; deployed and run in {time.perf_counter() - t0:.0f} s; a block from "
                    + (", ".join(f"the {k} tier {v:.2f} ms" for k, v in r["fetch_ms_per_block"].items()) or "no tier")
                    + f", a token prefilled {r['prefill_ms_per_token']:.2f} ms)",
                    flush=True,
                )
    finally:
        serve.shutdown()
        ray.shutdown()
    return runs

"""`shoal bench kv-tier`: agent traffic (benchmarks/agent_workload.py) on one
engine with the KV tiers off, then each on; then on --workers engines of
this process that take the requests in turn (round-robin), the tiers off
and the cluster tier on; all in one run.

Each configuration serves the same conversations, one request at a time,
interleaved turn by turn, through a paged cache too small to keep them all
(--num-kv-blocks; by default the longest request's blocks and a quarter more). Printed
per configuration: seconds, output tokens/s, the prefix hit rate (device and
tiers) against the ideal (every token a turn's prompt shares with what the
conversation sent and got back before, and the system prompt after its
first use), and the TTFT p50 of the turns after each conversation's first.
Then:
- after a restart: a new engine on the disk tier's folder serves one more
  turn of every conversation; its hits against the ideal;
- nothing reusable: unique prompts with the tiers off, the host tier on,
  and the host and disk tiers on (the engines taking each request in turn);
- what a block costs to fetch from each tier, and a token to prefill.
With --serve, instead: the conversations on real workers (kv_tier_serve.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

from shoal.benchmarks.agent_workload import (
    AgentWorkload,
    Conversation,
    interleaved,
    make_conversations,
    summarize,
    unique_prompts,
)
from shoal.workers.engine_args import EngineArgs

# The goals on the CPU.
GOALS = {
    "ttft_p50_speedup": 5.0,
    "throughput_speedup": 2.0,
    "restart_hit_share": 0.9,
    "unique_within": 0.03,
    "cluster_hit_share": 0.9,  # of the ideal, the turns round-robin over the engines
}


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def add_parser(sub) -> None:
    p = sub.add_parser("kv-tier", help="agent conversations on one engine, KV tiers off and on")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=_range, default=(6, 10), help="turns per conversation, a range lo-hi")
    p.add_argument("--system-len", type=int, default=2000, help="tokens of the shared system prompt")
    p.add_argument("--turn-len", type=_range, default=(200, 600), help="tokens each turn adds, lo-hi")
    p.add_argument("--reply-len", type=_range, default=(16, 64), help="tokens of each reply, lo-hi")
    p.add_argument("--unique-requests", type=int, default=16, help="requests of the nothing-reusable runs")
    p.add_argument("--host-bytes", type=int, default=2 << 30, help="the host tier's bytes")
    p.add_argument("--disk-bytes", type=int, default=16 << 30, help="the disk tier's bytes")
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="engines (in this process) that the multi-engine runs, tiers off and the cluster tier on, share (1: none)",
    )
    p.add_argument(
        "--routing",
        choices=("round-robin", "random"),
        default="round-robin",
        help="how the multi-engine runs pick a turn's engine: the next in turn, or one at random (seeded), "
        "as a load balancer blind to prefixes does",
    )
    p.add_argument("--cluster-bytes", type=int, default=4 << 30, help="the cluster tier's bytes")
    p.add_argument(
        "--serve",
        action="store_true",
        help="instead: the conversations on --workers real workers in a local Ray cluster, as `shoal serve` "
        "deploys them, under each --serve-routing policy, the cluster tier off and on (kv_tier_serve.py)",
    )
    p.add_argument(
        "--unique-only",
        action="store_true",
        help="only the nothing-reusable comparison (unique prompts, tiers off and on)",
    )
    p.add_argument(
        "--serve-routing",
        default="round-robin,kv",
        help="with --serve: the routing policies, comma-separated (default: round-robin,kv)",
    )
    p.add_argument("--output", default="bench_results/kv_tier.json")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def _serve(engine, requests) -> list[dict]:
    """Each (ids, max_tokens) to its end before the next: its TTFT, cached
    tokens and output ids."""
    from shoal.proto.messages import GenerateRequest
    from shoal.proto.sampling_params import SamplingParams

    out = []
    for i, (ids, max_tokens) in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(GenerateRequest(f"kv-{i}-{engine.num_steps}", list(ids), params))
        tokens, last = [], None
        while engine.has_unfinished_requests():
            for d in engine.step():
                tokens += d.new_token_ids
                last = d
        t = last.timings
        out.append({"ttft_s": t.first_token - t.arrival, "cached": last.num_cached_tokens, "ids": tokens})
    return out


def _conversation_run(
    args: EngineArgs, w: AgentWorkload, vocab: int, workers: int = 1, routing: str = "round-robin"
) -> tuple[dict, list[Conversation]]:
    """The conversations, turn by turn; with several engines (workers, in
    this process: a cluster tier is the process's store), each request goes
    to the next engine in turn, as --routing round-robin sends it, or to one
    drawn at random (seeded: every configuration draws the same)."""
    import random

    from shoal.workers import LLMEngine
    from shoal.workers.kv_transfer.cluster_tier import reset_process_store

    bs = args.block_size
    convs = make_conversations(w, vocab)
    reset_process_store()  # every configuration starts with an empty cluster tier
    engines = []
    try:
        for _ in range(workers):
            engines.append(LLMEngine(args))
        for engine in engines:
            _serve(engine, [(convs[0].context[:64], 2)])  # warm-up, a prompt none shares a block with past its first
            engine.block_manager.pool.num_hit_tokens = engine.block_manager.pool.num_query_tokens = 0
        rows, seen_system, last_engine, moved = [], False, {}, 0
        draw = random.Random(w.seed + 3)
        t0 = time.perf_counter()
        for k, (conv, t) in enumerate(interleaved(convs)):
            user, reply = conv.turns[t]
            prompt = conv.context + user
            ideal = conv.reused if (t or seen_system) else 0
            ideal = min(ideal // bs, (len(prompt) - 1) // bs) * bs
            e = k % workers if routing == "round-robin" else draw.randrange(workers)
            moved += t > 0 and last_engine[id(conv)] != e
            last_engine[id(conv)] = e
            (r,) = _serve(engines[e], [(prompt, reply)])
            seen_system = True
            conv.context = prompt + r["ids"]
            conv.reused = len(conv.context) - 1  # the reply's last token was never computed
            rows.append({"turn": t, "prompt": len(prompt), "ideal": ideal, **{k: r[k] for k in ("ttft_s", "cached")}})
        seconds = time.perf_counter() - t0
        tiers: dict[str, dict] = {}
        for engine in engines:  # summed over the engines
            for name, stats in engine.kv_tier_stats().items():
                into = tiers.setdefault(name, {})
                for field, value in dataclasses.asdict(stats).items():
                    if isinstance(value, list):  # a histogram's counts
                        into[field] = [a + b for a, b in zip(into.get(field, [0] * len(value)), value, strict=True)]
                    else:
                        into[field] = into.get(field, 0) + value
    finally:
        for engine in engines:
            engine.shutdown()
        reset_process_store()
    return {
        **summarize(rows, convs, seconds, moved),
        # what a block loaded from each tier took, measured in the run (a load: one request's blocks)
        "fetch_ms_per_block": {
            name: t["load_us"] / t["loaded_blocks"] / 1000 for name, t in tiers.items() if t["loaded_blocks"]
        },
        "tiers": tiers,
    }, convs


def _speedup(name: str, r: dict, base: dict, hit_goal: bool) -> None:
    """r's TTFT and throughput against base's, kept in r and printed beside the goals."""
    r["ttft_p50_speedup"] = base["ttft_p50_later_turns_s"] / max(r["ttft_p50_later_turns_s"], 1e-9)
    r["throughput_speedup"] = r["output_tok_s"] / base["output_tok_s"]
    print(
        f"  {name}: TTFT p50 of later turns {r['ttft_p50_speedup']:.1f}x lower (goal "
        f"{GOALS['ttft_p50_speedup']:.0f}x), throughput {r['throughput_speedup']:.2f}x (goal "
        f"{GOALS['throughput_speedup']:.0f}x), hits {r['hit_share_of_ideal']:.1%} of the ideal"
        + (f" (goal {GOALS['cluster_hit_share']:.0%})" if hit_goal else "")
    )


def _restart_run(args: EngineArgs, convs: list[Conversation], w: AgentWorkload, vocab: int) -> dict:
    """One more turn of every conversation on a fresh engine over the same disk folder."""
    import random

    from shoal.workers import LLMEngine

    bs = args.block_size
    rng = random.Random(w.seed + 2)
    engine = LLMEngine(args)
    try:
        rows = []
        for conv in convs:
            prompt = conv.context + [rng.randrange(3, vocab) for _ in range(rng.randint(*w.turn_len))]
            (r,) = _serve(engine, [(prompt, 1)])
            ideal = min(conv.reused // bs, (len(prompt) - 1) // bs) * bs
            rows.append((r["cached"], ideal))
    finally:
        engine.shutdown()
    ideal = sum(i for _, i in rows)
    return {"hit_tokens": sum(c for c, _ in rows), "ideal_tokens": ideal, "hit_share": sum(c for c, _ in rows) / ideal}


def _unique_run(configs: dict[str, EngineArgs], requests) -> dict[str, dict]:
    """The requests on one engine per configuration, all alive at once, each
    request on every engine in turn, in an order reversed every request
    (ABBA): this machine's speed drifts by 5-10% over minutes (a shared
    host's neighbours), and so weighs on each alike. An engine's time for a
    request includes writing its disk tier's file, to the disk (waited for),
    so no write spills into another engine's time: an upper bound on what
    the disk tier costs, whose writes would otherwise overlap the next steps."""
    from shoal.workers import LLMEngine

    engines = {}
    try:
        for name, cfg in configs.items():
            engines[name] = engine = LLMEngine(cfg)
            _serve(engine, [(requests[0][0][:64], 2)])
        seconds = dict.fromkeys(configs, 0.0)
        flushing = dict.fromkeys(configs, 0.0)  # of which, waiting for the disk tier's writes after the request
        tokens = dict.fromkeys(configs, 0)
        names = list(configs)
        for i, request in enumerate(requests):
            for name in names if i % 2 == 0 else names[::-1]:
                engine = engines[name]
                t0 = time.perf_counter()
                (r,) = _serve(engine, [request])
                connector = getattr(engine.runner, "kv_connector", None)
                if getattr(connector, "disk_storage", None) is not None:
                    t1 = time.perf_counter()
                    connector.disk_storage.flush()
                    os.sync()  # the kernel's writeback too, which would run into the next engine's request
                    flushing[name] += time.perf_counter() - t1
                seconds[name] += time.perf_counter() - t0
                tokens[name] += len(r["ids"])
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {
        name: {"seconds": seconds[name], "flush_s": flushing[name], "output_tok_s": tokens[name] / seconds[name]}
        for name in configs
    }


def _costs(args: EngineArgs, vocab: int, folder: str) -> dict:
    """ms to fetch one block from each tier (up to 64 blocks moved at once,
    the disk's from the page cache), and ms per token of a prefill of up to
    1,024 tokens (as many as the cache holds)."""
    from shoal.workers import LLMEngine
    from shoal.workers.kv_transfer.disk_tier import DiskTierStorage
    from shoal.workers.kv_transfer.factory import kv_cache_spec
    from shoal.workers.kv_transfer.host_tier import HostTierStorage, block_shape

    engine = LLMEngine(dataclasses.replace(args, kv_offload_host_bytes=0, kv_offload_disk_path=None))
    try:
        n_tokens = min(1024, (engine.block_manager.num_total_blocks - 1) * args.block_size)
        prompt = [(i * 7919) % (vocab - 3) + 3 for i in range(n_tokens)]
        _serve(engine, [(prompt[:64], 1)])
        (r,) = _serve(engine, [(prompt, 1)])
        prefill_ms = 1000 * r["ttft_s"] / len(prompt)
        kv = engine.runner.kv_cache
        spec = kv_cache_spec(engine.model_config, args.block_size, kv.dtype, 1)
        n = min(64, kv.shape[2])
        blocks = list(range(n))
        host = HostTierStorage(spec, n, kv.dtype)
        host.save(kv, blocks, blocks)
        t0 = time.perf_counter()
        host.load(kv, blocks, blocks)
        host_ms = 1000 * (time.perf_counter() - t0) / n
        disk = DiskTierStorage(block_shape(spec), kv.dtype)
        path = os.path.join(folder, "costs.kv")
        keys = [i.to_bytes(32, "little") for i in blocks]
        disk.save(kv, path, blocks, keys)
        disk.flush()
        t0 = time.perf_counter()
        ok = all(disk.load(kv, path, i, keys[i], b) for i, b in enumerate(blocks))
        disk_ms = 1000 * (time.perf_counter() - t0) / n
        disk.shutdown()
        assert ok, "the disk tier's cost file did not read back"
        bytes_per_block = kv[:, :, 0].numel() * kv.element_size()
    finally:
        engine.shutdown()
    return {
        "prefill_tokens": len(prompt),
        "prefill_ms_per_token": prefill_ms,
        "prefill_ms_per_block": prefill_ms * args.block_size,
        "host_ms_per_block": host_ms,
        "disk_ms_per_block": disk_ms,
        "bytes_per_block": bytes_per_block,
    }


def _unique_report(ns, configs: dict[str, EngineArgs], w: AgentWorkload, vocab: int, tmp: str) -> dict:
    """Unique prompts with the tiers off, the host tier on, both tiers on: printed, and returned."""
    unique = unique_prompts(w, vocab, ns.unique_requests)
    both = dataclasses.replace(
        configs["disk tier"], kv_offload_host_bytes=ns.host_bytes, kv_offload_disk_path=os.path.join(tmp, "u")
    )
    u = _unique_run(
        {"tiers off": configs["tiers off"], "host tier": configs["host tier"], "host and disk tiers": both}, unique
    )
    u_off = u["tiers off"]
    ratios = {name: r["output_tok_s"] / u_off["output_tok_s"] for name, r in u.items() if r is not u_off}
    print(
        f"  nothing reusable ({len(unique)} unique prompts): tiers off {u_off['output_tok_s']:.2f} tok/s, "
        + ", ".join(f"{name} {x:.3f}x" for name, x in ratios.items())
        + f" (goal within {GOALS['unique_within']:.0%})"
    )
    disk = u["host and disk tiers"]
    print(
        f"    of the disk tier's {disk['seconds']:.1f} s, {disk['flush_s']:.1f} s waited for its writes after "
        "each request (an upper bound: serving, they overlap the next steps)"
    )
    return {**u, "on_vs_off": ratios}


def _serve_report(ns, args: EngineArgs, w: AgentWorkload, vocab: int, report: dict) -> int:
    from shoal.benchmarks.kv_tier_serve import serve_runs

    print(f"  {'':32s} {'seconds':>8s} {'out tok/s':>10s} {'hits / ideal':>13s} {'TTFT p50, later turns':>22s}")
    policies = [p for p in ns.serve_routing.split(",") if p]
    runs = serve_runs(args, w, vocab, max(2, ns.workers), ns.cluster_bytes, policies)
    for name, r in runs.items():
        if not name.endswith("cluster tier"):
            continue
        _speedup(name, r, runs[name.replace("cluster tier", "tiers off")], hit_goal=True)
    shas = {r["replies_sha256"] for r in runs.values()}
    print("  the replies are the same in every configuration" if len(shas) == 1 else f"  replies: {len(shas)} kinds")
    report.update(serve_runs=runs, same_replies=len(shas) == 1)
    return _write(ns, report)


def _write(ns, report: dict) -> int:
    report["goals"] = GOALS
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {ns.output}")
    return 0


def run(ns) -> int:
    from shoal.workers.model_executor.loader.model_loader import load_model_files

    args = EngineArgs.from_cli_args(ns)
    w = AgentWorkload(ns.conversations, ns.turns, ns.system_len, ns.turn_len, ns.reply_len, args.seed)
    loaded = load_model_files(args.model)
    vocab = loaded.config.vocab_size
    if args.num_kv_blocks is None:  # the longest request and a quarter more: the conversations cannot all stay
        longest = w.system_len + w.turns[1] * (w.turn_len[1] + w.output_len[1])
        args = dataclasses.replace(args, num_kv_blocks=-(-5 * longest // (4 * args.block_size)))
    report: dict = {"model": loaded.name, "workload": dataclasses.asdict(w), "num_kv_blocks": args.num_kv_blocks}
    print(
        f"{loaded.name}: {w.conversations} conversations of {w.turns[0]}-{w.turns[1]} turns, system prompt "
        f"{w.system_len}, turns {w.turn_len[0]}-{w.turn_len[1]}, replies {w.output_len[0]}-{w.output_len[1]} "
        f"tokens; paged cache {args.num_kv_blocks} blocks of {args.block_size}"
    )
    if ns.serve:
        return _serve_report(ns, args, w, vocab, report)
    with tempfile.TemporaryDirectory() as tmp:
        configs = {
            "tiers off": dataclasses.replace(args, kv_offload_host_bytes=0, kv_offload_disk_path=None),
            "host tier": dataclasses.replace(args, kv_offload_host_bytes=ns.host_bytes, kv_offload_disk_path=None),
            "disk tier": dataclasses.replace(
                args,
                kv_offload_host_bytes=0,
                kv_offload_disk_path=os.path.join(tmp, "disk"),
                kv_offload_disk_bytes=ns.disk_bytes,
            ),
        }
        if ns.unique_only:
            report["unique"] = _unique_report(ns, configs, w, vocab, tmp)
            return _write(ns, report)
        workers = {name: 1 for name in configs}
        if ns.workers > 1:
            rr = f"{ns.workers} engines {ns.routing}"
            configs[f"{rr}, tiers off"] = configs["tiers off"]
            configs[f"{rr}, cluster tier"] = dataclasses.replace(
                configs["tiers off"], kv_cluster_tier="object-store", kv_cluster_bytes=ns.cluster_bytes
            )
            workers.update({f"{rr}, tiers off": ns.workers, f"{rr}, cluster tier": ns.workers})
        runs, convs_after = {}, {}
        width = max(len(name) for name in configs)
        print(
            f"  {'':{width}s} {'seconds':>8s} {'out tok/s':>10s} {'hits / ideal':>13s} {'TTFT p50, later turns':>22s}"
        )
        for name, cfg in configs.items():
            r, convs_after[name] = _conversation_run(cfg, w, vocab, workers[name], ns.routing)
            runs[name] = r
            print(
                f"  {name:{width}s} {r['seconds']:8.1f} {r['output_tok_s']:10.1f} {r['hit_share_of_ideal']:12.1%} "
                f"{1000 * r['ttft_p50_later_turns_s']:19.0f} ms"
            )
        off = runs["tiers off"]
        same = {r["replies_sha256"] for r in runs.values()} == {off["replies_sha256"]}
        report["same_replies"] = same
        print("  the replies are the same in every configuration" if same else "  THE REPLIES DIFFER between them")
        for name in configs:
            if name.endswith("tiers off"):
                continue
            cluster = name.endswith("cluster tier")
            base = runs[name.replace("cluster tier", "tiers off")] if cluster else off
            _speedup(name, runs[name], base, hit_goal=cluster)
        for name, r in runs.items():
            if workers[name] > 1:
                print(f"  {name}: {r['moved_turn_share']:.0%} of the later turns went to another engine than the last")
        fetched = {tier: ms for r in runs.values() for tier, ms in r["fetch_ms_per_block"].items()}
        if fetched:
            print(
                "  a block loaded in the runs took "
                + ", ".join(f"{ms:.3f} ms from the {tier} tier" for tier, ms in fetched.items())
            )
        report["runs"] = runs
        restart = _restart_run(configs["disk tier"], convs_after["disk tier"], w, vocab)
        report["restart"] = restart
        print(
            f"  after a restart on the disk tier's folder: {restart['hit_share']:.1%} of the next turns' reusable "
            f"prefix hit (goal {GOALS['restart_hit_share']:.0%})"
        )
        report["unique"] = _unique_report(ns, configs, w, vocab, tmp)
        costs = _costs(args, vocab, tmp)
        report["costs"] = costs
        print(
            f"  a block ({costs['bytes_per_block'] / 1024:.0f} KiB, {args.block_size} tokens): prefilled "
            f"{costs['prefill_ms_per_block']:.2f} ms ({costs['prefill_ms_per_token']:.3f} ms a token of a "
            f"{costs['prefill_tokens']}-token prompt), from the host tier {costs['host_ms_per_block']:.3f} ms, from the disk tier "
            f"{costs['disk_ms_per_block']:.3f} ms (page cache)"
        )
    return _write(ns, report)

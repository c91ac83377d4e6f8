"""The `shoal` command."""

from __future__ import annotations

import argparse
import sys

from shoal.proto.messages import GenerateRequest
from shoal.workers.engine_args import EngineArgs


def cmd_generate(ns: argparse.Namespace) -> int:
    import time

    from shoal.workers import LLMEngine, SamplingParams

    args = EngineArgs.from_cli_args(ns)
    engine = LLMEngine(args)
    print(
        f"loaded {engine.model_name} in {engine.load_time_s:.1f} s "
        f"({engine.block_manager.num_total_blocks} KV blocks of {args.block_size} tokens)",
        file=sys.stderr,
    )
    prompt = ns.prompt
    if not ns.raw and engine.tokenizer is not None and engine.tokenizer.chat_template:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    # The one --seed seeds the engine and, as before, this request's sampling.
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, seed=args.seed)
    t0 = time.perf_counter()
    engine.add_request(GenerateRequest("cli", engine.tokenize(prompt), params))
    n = 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                n += len(out.new_token_ids)
                print(out.new_text, end="", flush=True)
    finally:
        engine.shutdown()  # the other tensor-parallel ranks, if any
    dt = time.perf_counter() - t0
    print(f"\n[{n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="shoal: serve open-weight LLMs")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply to one prompt on this machine")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    EngineArgs.add_cli_args(g)
    g.set_defaults(func=cmd_generate)

    from shoal.cluster import serve_cmd

    serve_cmd.add_parser(sub)

    b = sub.add_parser("bench", help="benchmarks that print tables and write JSON")
    bsub = b.add_subparsers(dest="bench", required=True)
    # The one edge from the command to the benchmarks: they never import this module.
    from shoal.benchmarks import (
        calibrate,
        gpu,
        kv_tier,
        latency,
        lora,
        offline,
        prepare_cost,
        roofline,
        routing,
        scheduler,
        serve,
        soak,
        structured,
        tp,
        tune_cb,
    )

    benches = (
        offline,
        tune_cb,
        serve,
        latency,
        scheduler,
        tp,
        gpu,
        calibrate,
        routing,
        soak,
        prepare_cost,
        structured,
        lora,
        roofline,
        kv_tier,
    )
    for bench in benches:
        bench.add_parser(bsub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:  # bad flags or model: say why, no traceback
        print(f"shoal {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

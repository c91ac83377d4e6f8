"""The `shoal` command."""

from __future__ import annotations

import argparse
import sys


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model across this many ranks (GPUs), Megatron-style")  # fmt: skip


def engine_args_from(ns: argparse.Namespace):
    from shoal.workers import EngineArgs

    return EngineArgs(model=ns.model, dtype=ns.dtype, device=ns.device, block_size=ns.block_size,
                      max_num_batched_tokens=ns.max_num_batched_tokens, max_num_seqs=ns.max_num_seqs,
                      kv_cache_memory_bytes=ns.kv_cache_memory_bytes, num_kv_blocks=ns.num_kv_blocks,
                      max_model_len=ns.max_model_len, enable_prefix_caching=not ns.no_prefix_caching,
                      tensor_parallel_size=ns.tensor_parallel_size)  # fmt: skip


def cmd_generate(ns: argparse.Namespace) -> int:
    import time

    from shoal.workers import LLMEngine, SamplingParams

    engine = LLMEngine(engine_args_from(ns))
    print(f"loaded {engine.model_name} in {engine.load_time_s:.1f} s "
          f"({engine.block_manager.num_total_blocks} KV blocks of {ns.block_size} tokens)", file=sys.stderr)  # fmt: skip
    prompt = ns.prompt
    if not ns.raw and engine.tokenizer is not None and engine.tokenizer.chat_template:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, seed=ns.seed)
    t0 = time.perf_counter()
    engine.add_request("cli", prompt, params)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal", description="shoal: serve open-weight LLMs")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply to one prompt on this machine")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _engine_flags(g)
    g.set_defaults(func=cmd_generate)

    from shoal.cluster import serve_cmd

    serve_cmd.add_parser(sub, _engine_flags)

    b = sub.add_parser("bench", help="benchmarks that print tables and write JSON")
    bsub = b.add_subparsers(dest="bench", required=True)
    from shoal.benchmarks import offline, scheduler, serve, tp

    offline.add_parser(bsub, _engine_flags)
    serve.add_parser(bsub, _engine_flags)
    scheduler.add_parser(bsub)
    tp.add_parser(bsub, _engine_flags)

    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:  # bad flags or model: say why, no traceback
        print(f"shoal {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

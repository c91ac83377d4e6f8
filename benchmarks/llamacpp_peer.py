"""llama.cpp (through llama-cpp-python) as a peer on the same GGUF file.

`shoal bench latency` runs it beside shoal when the package is importable:
the same prompts (token ids, fed in directly so tokenisation cannot differ),
the same output length and thread count, one stream, greedy (the argmax of
the last logits each step, EOS ignored). scripts/pin_llamacpp_reference.py
pins its greedy tokens and a perplexity with the same functions.
"""

from __future__ import annotations

import statistics
import time

NOT_INSTALLED = "llama.cpp: not installed (pip install llama-cpp-python)"


def import_llama_cpp():
    """The llama_cpp module, or None where it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def load(path: str, threads: int, n_ctx: int = 2048, logits_all: bool = False):
    """A llama.cpp context on `path`: `threads` for decode and prompt alike,
    one prompt batch up to n_ctx, the KV cache in llama.cpp's default f16."""
    llama_cpp = import_llama_cpp()
    return llama_cpp.Llama(
        model_path=path,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        seed=0,
        verbose=False,
    )


def _clear(llm) -> None:
    """Forget the previous sequence: the token count and the KV cache, so no
    prefix is reused from it."""
    llm.reset()
    llm._ctx.kv_cache_clear()


def _last_logits(llm):
    """The logits of the last token evaluated, as a numpy view (no copy)."""
    import numpy as np

    llama_cpp = import_llama_cpp()
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def greedy(llm, prompt: list[int], n: int, times: list[float] | None = None) -> list[int]:
    """`n` tokens after `prompt`, each the argmax of the last logits (EOS is
    not special); the prompt is evaluated as one batch, then token by token.
    With `times`, appends the perf_counter time each token was known."""
    _clear(llm)
    llm.eval(prompt)
    out = []
    for i in range(n):
        out.append(int(_last_logits(llm).argmax()))
        if times is not None:
            times.append(time.perf_counter())
        if i + 1 < n:
            llm.eval([out[-1]])
    return out


def perplexity(llm, ids: list[int]) -> float:
    """exp(mean NLL of tokens 1..n-1 given the ones before), in float64 from
    llama.cpp's logits of one batch over all of `ids` (llm made with
    logits_all=True)."""
    import numpy as np

    _clear(llm)
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
    top = logits.max(axis=1, keepdims=True)
    logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    nll = logz - logits[np.arange(len(ids) - 1), ids[1:]]
    return float(np.exp(nll.mean()))


def version() -> str:
    return import_llama_cpp().__version__


def run_latency(path: str, prompts: list[list[int]], output_len: int, threads: int, warmup: int) -> dict | None:
    """One stream on llama.cpp over the bench's prompts, the first `warmup`
    not counted: TTFT (prompt batch to the first token's argmax) and the gaps
    between later tokens, reported as shoal's are. Prints a line saying why
    and returns None where it cannot run."""
    if import_llama_cpp() is None:
        print(NOT_INSTALLED)
        return None
    if not path.endswith(".gguf"):
        print(f"llama.cpp: skipped ({path} is not a .gguf file)")
        return None
    llm = load(path, threads, n_ctx=max(len(p) for p in prompts) + output_len)
    ttfts, tpots = [], []
    for i, prompt in enumerate(prompts):
        times: list[float] = []
        t0 = time.perf_counter()
        greedy(llm, prompt, output_len, times)
        if i >= warmup:
            ttfts.append(times[0] - t0)
            tpots.extend(b - a for a, b in zip(times, times[1:]))
    llm.close()
    return {"version": version(), "threads": threads, "ttft_s": ttfts, "tpot_s": tpots}


def summarize(r: dict, pct) -> dict:
    """The peer's figures in the shape of shoal's report (ms, tok/s)."""
    tpot50 = statistics.median(r["tpot_s"])
    return {
        "version": r["version"],
        "threads": r["threads"],
        "ttft_ms": {"p50": statistics.median(r["ttft_s"]) * 1e3, "p99": pct(r["ttft_s"], 0.99) * 1e3},
        "tpot_ms": {"p50": tpot50 * 1e3, "p99": pct(r["tpot_s"], 0.99) * 1e3},
        "decode_tok_s": 1 / tpot50,
    }

"""Where an engine step goes, grouped by part, for `shoal bench latency
--profile`: the linear layers by the arithmetic they multiply in, attention
for prefill chunks and for decodes, the rest of the forward (norms, rotary,
activation, embedding, Python), the sampler, input preparation (staging and
attention metadata), the scheduler, the detokenizer and the rest of the
step. Measured for one stream's decode steps, a batch of decoding sequences,
and that batch with a prefill chunk in the same step (the serving case).

The parts come from the engine's named ranges (shoal.workers.profiling),
forward hooks on the linear layers and the LM head, and, inside the
one-call CPU decode step, the times its own ops report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shoal.proto.messages import GenerateRequest

# The one-call decode step's ops that are matrices (the rest: norms, rotary, activation).
FUSED_MATRICES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PART_ORDER = (
    "attention (prefill)",
    "attention (decode)",
    "rest of the forward (norms, rotary, activation, embedding, Python)",
    "sampler",
    "input preparation (staging, attention metadata)",
    "scheduler (schedule, update from output)",
    "detokenizer and output deltas",
    "rest of the step (engine bookkeeping)",
)


def arithmetic(module) -> str:
    """What a linear layer multiplies in, as its weights are stored."""
    from shoal.workers.model_executor.layers.quantization.gguf import GGUFLinearMethod
    from shoal.workers.model_executor.layers.quantization.int8 import Int8LinearMethod

    method = getattr(module, "quant_method", None)
    if isinstance(method, GGUFLinearMethod):
        return "int8 dot products (GGUF blocks)"
    if isinstance(method, Int8LinearMethod):
        return "int8 dot products (W8A8)"
    dtype = getattr(getattr(module, "weight", None), "dtype", None)
    return {"torch.bfloat16": "bfloat16 weights", "torch.float8_e4m3fn": "fp8"}.get(str(dtype), "float32")


@dataclass(slots=True)
class StepProfile:
    """The summed seconds of `steps` steps, by part."""

    label: str
    steps: int = 0
    seconds: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)

    def table(self) -> list[tuple[str, float, float]]:
        """(part, ms a step, share of the step) rows, linear layers first."""
        rows = [(n, s) for n, s in self.parts.items() if n.startswith("linear")]
        rows += [(n, self.parts.get(n, 0.0)) for n in PART_ORDER]
        return [(n, 1e3 * s / self.steps, s / self.seconds) for n, s in rows]

    def print(self) -> None:
        print(f"  {self.label}: {1e3 * self.seconds / self.steps:.2f} ms a step ({self.steps} steps)")
        for name, ms, share in self.table():
            print(f"    {name:68} {ms:8.2f} ms {100 * share:5.1f}%")

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "steps": self.steps,
            "step_ms": 1e3 * self.seconds / self.steps,
            "parts_ms": {n: ms for n, ms, _ in self.table()},
        }


class StepProfiler:
    """Times the engine's steps by part while open (a context manager):
    each measured step is one call of step()."""

    def __init__(self, engine):
        self.engine = engine
        runner = engine.runner
        self.model = runner.model
        self.decode_step = runner.cpu_decode_step
        self.linear_s: dict[str, float] = {}
        self._handles: list = []

    def __enter__(self) -> StepProfiler:
        from shoal.workers import profiling
        from shoal.workers.model_executor.layers.linear import LinearBase

        for m in self.model.modules():
            if isinstance(m, LinearBase) or m is self.model.lm_head:
                part = "linear, " + arithmetic(m) + (" (LM head)" if m is self.model.lm_head else "")
                self._handles += _time_module(m, self.linear_s, part)
        self.layers = self.decode_step.bound_layers() if self.decode_step is not None else None
        if self.layers is not None:
            self.layers.timing = True
            self.layers.op_seconds()  # zeroes them
        self._op_arith = {n: arithmetic(getattr(self.model.layers[0].self_attn, n, None)) for n in FUSED_MATRICES[:2]}
        mlp = self.model.layers[0].mlp
        self._op_arith.update({n: arithmetic(getattr(mlp, n, None)) for n in FUSED_MATRICES[2:]})
        profiling.enable()
        return self

    def __exit__(self, *exc) -> None:
        from shoal.workers import profiling

        profiling.enable(False)
        for h in self._handles:
            h.remove()
        if self.layers is not None:
            self.layers.timing = False

    def measure(self, label: str, steps: int, before_step=None) -> StepProfile:
        """`steps` engine steps (before_step(i) runs ahead of each, untimed), by part."""
        from shoal.workers import profiling

        profiling.reset()
        self.linear_s.clear()
        if self.layers is not None:
            self.layers.op_seconds()
        total = 0.0
        for i in range(steps):
            if before_step is not None:
                before_step(i)
            t0 = time.perf_counter()
            self.engine.step()
            total += time.perf_counter() - t0
        r = profiling.seconds()
        parts = dict(self.linear_s)
        attn_decode = r.get("attention_decode", 0.0)
        if self.layers is not None:
            for name, sec in self.layers.op_seconds().items():
                if name in self._op_arith:
                    key = "linear, " + self._op_arith[name]
                    parts[key] = parts.get(key, 0.0) + sec
                elif name == "attention":
                    attn_decode += sec  # the other ops stay in the forward's remainder
        linear = sum(parts.values())
        parts["attention (prefill)"] = r.get("attention_prefill", 0.0)
        parts["attention (decode)"] = attn_decode
        forward = r.get("forward", 0.0)
        parts[PART_ORDER[2]] = forward - linear - parts["attention (prefill)"] - attn_decode
        parts["sampler"] = r.get("sample", 0.0)
        parts[PART_ORDER[4]] = r.get("execute_model", 0.0) - forward - r.get("sample", 0.0)
        parts[PART_ORDER[5]] = r.get("schedule", 0.0) + r.get("update_from_output", 0.0)
        parts[PART_ORDER[6]] = r.get("detokenize", 0.0)
        known = ("schedule", "execute_model", "update_from_output", "detokenize")  # grammar masks: the rest
        parts[PART_ORDER[7]] = total - sum(r.get(k, 0.0) for k in known)
        return StepProfile(label, steps, total, parts)


def profile_steps(engine, prompt_len: int, batch: int, prefill_len: int, steps: int, rng) -> list[StepProfile]:
    """One stream's decode steps, then `batch` sequences decoding together,
    then that batch with a fresh prompt of prefill_len tokens in each
    measured step (its prefill in one chunk). Every request is aborted after."""
    from shoal.workers import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=4 * steps + 16, ignore_eos=True)
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    ids: list[str] = []

    def add(n: int, p=params) -> None:
        ids.append(f"step-profile-{len(ids)}")
        engine.add_request(GenerateRequest(ids[-1], engine.tokenize(prompt(n)), p))

    out = []
    try:
        with StepProfiler(engine) as prof:
            add(prompt_len)
            engine.step()  # its prefill, not counted
            out.append(prof.measure("one stream, decode steps", steps))
            for _ in range(batch - 1):
                add(prompt_len)
            prefilling = set(ids[1:])
            while prefilling:  # the prefills, not counted
                prefilling -= {o.request_id for o in engine.step() if o.new_token_ids}
            out.append(prof.measure(f"{batch} sequences decoding", steps))
            out.append(
                prof.measure(
                    f"{batch} sequences decoding + a {prefill_len}-token prompt",
                    max(1, steps // 2),
                    lambda i: add(prefill_len, one_token),
                )
            )
    finally:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return out


def _time_module(module, totals: dict, part: str) -> list:
    """Sum each call of `module` into totals[part] through its forward hooks; returns the handles."""
    started = []

    def before(*_):
        started.append(time.perf_counter())

    def after(*_):
        totals[part] = totals.get(part, 0.0) + time.perf_counter() - started.pop()

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

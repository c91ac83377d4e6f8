"""load_format "simulated": the real scheduler, block manager and prefix
cache over a stand-in model, so the router can be studied with more
replicas than this machine could serve.

SimulatedRunner has ModelRunner's step interface but no weights and no KV
tensors. Each step it picks stand-in tokens (a hash of the request's
sampling seed, or of its prompt when greedy, with the output index, as the
real sampler's draws are) and sleeps for the step time a cost model gives:

    overhead + prefill tokens x a + decode sequences x b + decode context tokens x c

(a decode's context is its sequence length: the keys its attention reads).
time.sleep lets go of the GIL, so dozens of simulated replicas share a few
cores. `calibrate` fits the coefficients to the real engine on this
machine; `shoal bench calibrate` prints the fit and writes the JSON that
--simulated-cost-model reads.

Stand-in tokens are never an eos id nor one of the request's stop tokens:
every request runs to max_tokens (or max_model_len) unless a stop string
turns up in its stand-in text.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from shoal.workers.core.outputs import ModelRunnerOutput
from shoal.workers.core.scheduler import SchedulerOutput
from shoal.workers.core.sequence import Sequence

logger = logging.getLogger(__name__)

_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's time depends on."""

    prefill_tokens: int = 0  # new tokens of the rows with more than one
    decode_seqs: int = 0  # rows with one new token
    decode_context_tokens: int = 0  # the decode rows' sequence lengths, summed

    @classmethod
    def of(cls, scheduled: Iterable[tuple[Sequence, int]]) -> StepShape:
        prefill = decodes = context = 0
        for seq, n in scheduled:
            if n > 1:
                prefill += n
            else:
                decodes += 1
                context += seq.num_computed_tokens + 1
        return cls(prefill, decodes, context)

    def features(self) -> tuple[float, float, float, float]:
        """The cost model's regressors, in StepCostModel's coefficient order."""
        return (1.0, self.prefill_tokens, self.decode_seqs, self.decode_context_tokens)

    def describe(self) -> str:
        parts = []
        if self.prefill_tokens:
            parts.append(f"prefill {self.prefill_tokens}")
        if self.decode_seqs:
            parts.append(f"decode {self.decode_seqs} x ctx {self.decode_context_tokens / self.decode_seqs:.0f}")
        return " + ".join(parts) or "empty"


@dataclass(slots=True)
class StepCostModel:
    """Seconds one step takes, linear in StepShape's features."""

    overhead_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    decode_s_per_context_token: float = 0.0
    source: str = ""  # how the coefficients were obtained

    def coefficients(self) -> tuple[float, float, float, float]:
        return (self.overhead_s, self.prefill_s_per_token, self.decode_s_per_seq, self.decode_s_per_context_token)

    def step_seconds(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients(), shape.features()))

    def describe(self) -> str:
        return (
            f"{1e3 * self.overhead_s:.2f} ms/step + {1e3 * self.prefill_s_per_token:.3f} ms/prefill token + "
            f"{1e3 * self.decode_s_per_seq:.3f} ms/decode seq + "
            f"{1e6 * self.decode_s_per_context_token:.3f} us/decode context token"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepCostModel:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# Measured on the development machine (2 CPU cores, nothing else running,
# SmolLM2-135M-Instruct in float32, 2 torch threads, the compiled CPU decode
# kernel) by `shoal bench calibrate` (bench_results/step_cost.json), in 91 s
# on 2026-11-30: the fastest of 5 rounds per shape. Fit error per shape:
# prefill 32/128/512 -17/+5/+4%, decode 1/8/32 at ctx 66 +14/-32/+10%,
# decode 16 at ctx 770 0%, held-out prefill 256 + decode 8 +5%.
DEFAULT_COST_MODEL = StepCostModel(
    overhead_s=0.09349,
    prefill_s_per_token=0.004564,
    decode_s_per_seq=0.008011,
    decode_s_per_context_token=7.159e-6,
    source="shoal bench calibrate: SmolLM2-135M-Instruct float32 on 2 CPU cores, 2026-11-30 (built-in default)",
)


def load_cost_model(path: str | None) -> StepCostModel:
    """The cost model in `path` (shoal bench calibrate's JSON: the model's
    fields at the top level or under "cost_model"), else the default."""
    if path is None:
        return DEFAULT_COST_MODEL
    with open(path) as f:
        d = json.load(f)
    return StepCostModel.from_dict(d.get("cost_model", d))


def fit_cost_model(shapes: list[StepShape], seconds: list[float], source: str = "") -> StepCostModel:
    """Least squares on relative error (each step weighted by 1/its time, so
    a 30 ms decode counts as much as a 1 s prefill), with no coefficient
    below zero: a negative one is dropped and the rest refitted. A feature
    no shape varies (all zero) gets 0."""
    if len(shapes) != len(seconds) or not shapes:
        raise ValueError("fit_cost_model needs one time per shape, and at least one")
    x = np.array([s.features() for s in shapes], dtype=np.float64)
    y = np.array(seconds, dtype=np.float64)
    w = 1.0 / np.maximum(y, 1e-9)
    active = [j for j in range(x.shape[1]) if j == 0 or np.any(x[:, j])]
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        del active[int(np.argmin(sol))]
    # the four coefficients in order, which mypy cannot count in a generator
    return StepCostModel(*(float(c) for c in coef), source=source)  # type: ignore[arg-type, misc]


def stand_in_token(key: int, index: int, vocab_size: int, banned: Iterable[int] = ()) -> int:
    """A token determined by (key, index) alone: splitmix64 of the pair,
    over the vocabulary, stepping past banned ids."""
    z = (key * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    token = (z ^ (z >> 31)) % vocab_size
    banned = set(banned)
    if len(banned) >= vocab_size:
        raise ValueError("every token id is banned")
    while token in banned:
        token = (token + 1) % vocab_size
    return token


@dataclass(slots=True)
class SimulatedStep:
    """A prepared step: its tokens, and how long it takes."""

    out: ModelRunnerOutput
    step_s: float


class SimulatedRunner:
    """ModelRunner's step interface over a stand-in model; see the module doc."""

    varlen = False  # never replays CUDA graphs
    graphs = None

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: list[int],
        cost: StepCostModel,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cost = cost
        self.sleep = sleep
        self.num_blocks: int | None = None
        self.num_steps = 0
        self.simulated_seconds = 0.0  # the cost model's step times, summed
        self._prompt_keys: dict[tuple[str, int], int] = {}
        logger.info("simulated model: steps take %s (%s)", cost.describe(), cost.source or "no source given")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Nothing to allocate: the block manager alone accounts for the blocks."""
        self.num_blocks = num_blocks

    def release_kv_cache(self) -> None:
        self.num_blocks = None

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """The step's stand-in tokens, after the cost model's step time
        (counted from the call, so this bookkeeping is inside it)."""
        t0 = time.perf_counter()
        return self.run_prepared(self.prepare(sched), started=t0)

    def prepare(self, sched: SchedulerOutput) -> SimulatedStep:
        """The step's tokens, from its sequences as they are now (a stand-in
        token needs no token before it, so a placeholder is never read)."""
        step_s = self.cost.step_seconds(StepShape.of(sched.scheduled))
        seqs = sched.seqs_due_token
        tokens, logprobs = [], []
        for seq in seqs:
            p = seq.params
            key = seq.sampling_seed if seq.sampling_seed is not None else self._prompt_key(seq)
            banned = (*self.eos_token_ids, *p.stop_token_ids)
            token = stand_in_token(key, seq.num_output_tokens, self.vocab_size, banned)
            tokens.append(token)
            # A stand-in is certain of its token: logprob 0.
            logprobs.append(None if p.logprobs is None else (0.0, {token: 0.0} if p.logprobs else {}))
        if len(self._prompt_keys) > 4 * len(seqs) + 1024:  # forget finished requests
            live = {(s.request_id, s.arrival_order) for s in seqs}
            self._prompt_keys = {k: v for k, v in self._prompt_keys.items() if k in live}
        return SimulatedStep(ModelRunnerOutput(seqs, tokens, logprobs), step_s)

    def run_prepared(
        self, prep: SimulatedStep, previous: ModelRunnerOutput | None = None, started: float | None = None
    ) -> ModelRunnerOutput:
        """The step's time passes (from `started`, else now), then its tokens."""
        t0 = time.perf_counter() if started is None else started
        self.num_steps += 1
        self.simulated_seconds += prep.step_s
        left = t0 + prep.step_s - time.perf_counter()
        if left > 0:
            self.sleep(left)
        return prep.out

    def _prompt_key(self, seq: Sequence) -> int:
        """A greedy request's tokens follow from its prompt, as a model's would."""
        k = (seq.request_id, seq.arrival_order)
        key = self._prompt_keys.get(k)
        if key is None:
            # hash() of a tuple of ints is the same in every process (no PYTHONHASHSEED in it).
            key = self._prompt_keys[k] = hash(tuple(seq.token_ids[: seq.num_prompt_tokens])) & _MASK
        return key

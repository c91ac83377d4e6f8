"""deploy/serve.yaml is a valid Serve config whose import path builds the app,
and ServeOptions turns bad options into clear errors."""

from __future__ import annotations

import os

import pytest
import yaml

from shoal.cluster.options import ServeOptions
from shoal.workers.engine_args import EngineArgs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_serve_yaml_is_a_serve_config_whose_import_path_builds_the_app():
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from shoal.cluster.app import HEADROOM, worker_deployment_options

    with open(os.path.join(ROOT, "deploy", "serve.yaml")) as f:
        config = yaml.safe_load(f)
    schema = ServeDeploySchema.parse_obj(config)
    app = schema.applications[0]
    module, _, attr = app.import_path.partition(":")
    builder = getattr(__import__(module, fromlist=[attr]), attr)
    args = dict(app.args, device="cpu", max_num_seqs=8)
    opts = ServeOptions.from_dict(args)
    assert (opts.http_port, opts.grpc_port, opts.host) == (8000, 9000, "0.0.0.0")
    worker = worker_deployment_options(opts, gpu=opts.uses_gpu())
    assert worker["num_replicas"] == 1
    assert worker["ray_actor_options"]["num_cpus"] == 1.0 and "num_gpus" not in worker["ray_actor_options"]
    # max_num_seqs (as configured, no second default) + max_waiting + headroom
    assert worker["max_ongoing_requests"] == 8 + app.args["max_waiting"] + HEADROOM + 1  # + the router's delta stream
    assert "placement_group_strategy" not in worker  # one rank: no placement group
    assert isinstance(builder(args), Application)


def test_options_route_engine_fields_and_refuse_unknown_ones():
    opts = ServeOptions.from_dict({"num_workers": 2, "max_num_seqs": 8, "block_size": 32})
    assert opts.engine == EngineArgs(max_num_seqs=8, block_size=32)
    args = opts.worker_engine_args(gpu=False)
    assert args.device == "cpu" and args.max_num_seqs == 8 and args.block_size == 32
    assert args.num_threads == max(1, (os.cpu_count() or 1) // 2)  # the cores shared by the two workers
    assert opts.worker_engine_args(gpu=True).device == "auto"  # settled inside the worker, on its own GPU
    with pytest.raises(ValueError, match="unknown option 'num_wrokers'"):
        ServeOptions.from_dict({"num_wrokers": 2})
    with pytest.raises(ValueError, match="num_workers"):
        ServeOptions.from_dict({"num_workers": 0})


def test_tensor_parallel_options_build_one_strict_pack_group_per_replica():
    from shoal.cluster.app import worker_deployment_options

    opts = ServeOptions.from_dict({"num_workers": 2, "tensor_parallel_size": 2, "device": "cpu"})
    assert opts.tp_size == 2 and opts.worker_engine_args(gpu=False).tensor_parallel_size == 2
    worker = worker_deployment_options(opts, gpu=False)
    assert worker["placement_group_strategy"] == "STRICT_PACK"
    assert worker["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert worker["num_replicas"] == 2


def test_shoal_serve_refuses_a_size_that_cannot_split_the_model_before_ray_starts(tiny_model):
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "shoal.cluster.cli", "serve", "--model", tiny_model, "--tensor-parallel-size", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert p.stderr.strip() == (
        "shoal serve: error: tensor_parallel_size 3 does not divide the model's 4 attention heads"
    )  # nothing else: refused before Ray started


def test_routers_round_trip_through_the_cli_and_the_serve_config(tiny_model, capsys):
    from shoal.cluster.app import router_deployment_options
    from shoal.cluster.cli import build_parser, main
    from shoal.cluster.serve_cmd import ready_message

    ns = build_parser().parse_args(["serve", "--routers", "3", "--device", "cpu"])
    opts = ServeOptions.from_cli_args(ns)
    assert opts.routers == 3 and ServeOptions().routers == 1
    assert ServeOptions.from_dict(opts.to_dict()) == opts  # a Serve config's args carry it back
    router = router_deployment_options(opts)
    assert (router["num_replicas"], router["max_replicas_per_node"]) == (3, 1)
    assert "resources" not in router["ray_actor_options"]  # outside Ray: no shoal_router nodes to ask for
    with pytest.raises(ValueError, match="routers must be >= 1"):
        ServeOptions.from_dict({"routers": 0})
    # One router per node, and a local cluster is one node: refused before Ray starts.
    assert main(["serve", "--model", tiny_model, "--routers", "2"]) == 2
    assert "--routers 2 needs 2 Ray nodes" in capsys.readouterr().err
    ends = [
        {"model": "m", "http": "http://0.0.0.0:8000", "grpc": "0.0.0.0:9000", "node": ip}
        for ip in ("10.0.0.2", "10.0.0.1")
    ]
    msg = ready_message(opts, ends, 1.0)
    assert "  routers      2, each on both ports on its node: 10.0.0.1, 10.0.0.2" in msg
    assert "routers" not in ready_message(opts, ends[:1], 1.0)


def test_api_key_reaches_the_router_from_its_environment_never_its_init_args(monkeypatch, tiny_model, capsys):
    """Serve pickles a replica's init args into the cluster's state (and its
    dashboard shows runtime_env): the key goes by the raylet's environment."""
    import pickle

    from ray import cloudpickle

    from shoal.cluster.app import api_key_for_local_cluster, build_app
    from shoal.cluster.cli import main
    from shoal.router.options import RouterOptions

    monkeypatch.delenv("SHOAL_API_KEY", raising=False)
    opts = ServeOptions(api_key="flag-key", engine=EngineArgs(model=tiny_model, device="cpu"))
    with pytest.raises(ValueError, match=r"only as \$SHOAL_API_KEY"):
        build_app(opts)  # a key with nowhere to go is refused, never served as an open API
    with api_key_for_local_cluster(opts.resolved_api_key()):  # what `shoal serve` does around ray.init
        init_args = build_app(opts)._bound_deployment.init_args
        router = init_args[1]
        assert router.resolved_api_key() == "flag-key"  # what the Router reads, from the environment
    assert "SHOAL_API_KEY" not in os.environ  # put back as it was
    assert router.api_key is None and router.resolved_api_key() is None
    assert b"flag-key" not in cloudpickle.dumps(init_args)
    monkeypatch.setenv("SHOAL_API_KEY", "from-env")
    assert ServeOptions().router_options().resolved_api_key() == "from-env"
    # A key set on the options directly (a router built in-process) is kept out of repr and of pickles.
    direct = RouterOptions("m", "127.0.0.1", 8000, 9000, 1, 1 << 20, 30.0, api_key="sekret")
    assert "sekret" not in repr(direct) and "api_key=<hidden>" in repr(direct)
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(direct)
    keyless = ServeOptions().router_options()
    assert pickle.loads(pickle.dumps(keyless)) == keyless
    # `shoal serve --address`: the routers run in the nodes' environment, which this process cannot set.
    assert main(["serve", "--model", tiny_model, "--address", "auto", "--api-key", "k"]) == 2
    assert "start its nodes (`ray start`) with SHOAL_API_KEY" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_run_deploys_the_config_file(tmp_path):
    """`serve run deploy/serve.yaml` (ports and host changed for the test) serves, and Ctrl-C stops it."""
    with open(os.path.join(ROOT, "deploy", "serve.yaml")) as f:
        serve_run_and_complete(yaml.safe_load(f), tmp_path)


def serve_run_and_complete(config: dict, tmp_path) -> None:
    """`serve run` a Serve config (on this host's free ports, on the CPU) on a
    local Ray cluster it starts; a completion must come back; Ctrl-C stops it."""
    import signal
    import subprocess
    import sys
    import time

    import httpx
    from serving import free_port

    http = free_port()
    config["applications"][0]["args"].update(host="127.0.0.1", http_port=http, grpc_port=free_port(), device="cpu")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_bin = os.path.join(os.path.dirname(sys.executable), "serve")
    proc = subprocess.Popen(
        [serve_bin, "run", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"),
    )
    try:
        deadline, health = time.monotonic() + 240, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                health = httpx.get(f"http://127.0.0.1:{http}/health", timeout=2).status_code
            except httpx.HTTPError:
                health = None
            if health == 200:
                break
            time.sleep(1)
        assert health == 200, "serve run never became healthy"
        r = httpx.post(f"http://127.0.0.1:{http}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "stop", "--force"])


@pytest.mark.slow
def test_shoal_serve_joins_a_running_cluster_and_leaves_it_running(tmp_path):
    """`shoal serve --address` deploys onto a cluster started with `ray start`;
    Ctrl-C removes the app and leaves the cluster up."""
    import signal
    import subprocess
    import sys

    import httpx
    from serving import free_port

    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    subprocess.run(
        [
            os.path.join(bindir, "ray"),
            "start",
            "--head",
            "--num-cpus",
            "2",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=120,
    )
    try:
        http = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shoal.cluster.cli",
                "serve",
                "--address",
                "auto",
                "--device",
                "cpu",
                "--http-port",
                str(http),
                "--grpc-port",
                str(free_port()),
                "--num-kv-blocks",
                "256",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "; Ctrl-C stops" in line:  # the banner, not a replica's "kernels ready in" log line
                break
        assert any("; Ctrl-C stops" in ln for ln in lines), "".join(lines[-30:])
        r = httpx.post(f"http://127.0.0.1:{http}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
        # The cluster and its Serve instance stay up (other apps may be on it); shoal's app is gone.
        probe = (
            "import ray; from ray import serve; from ray.serve._private.constants import SERVE_CONTROLLER_NAME, "
            "SERVE_NAMESPACE; ray.init(address='auto', logging_level='ERROR'); "
            "ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE); "
            "print('serve up, apps:', sorted(serve.status().applications))"
        )
        status = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        assert "serve up, apps: []" in status.stdout, status.stdout + status.stderr[-800:]
    finally:
        subprocess.run([os.path.join(bindir, "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)

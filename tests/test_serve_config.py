"""deploy/serve.yaml is a valid Serve config whose import path builds the app,
and ServeOptions turns bad options into clear errors."""

from __future__ import annotations

import os

import pytest
import yaml

from shoal.cluster.options import ServeOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_serve_yaml_is_a_serve_config_whose_import_path_builds_the_app():
    from ray.serve.schema import ServeDeploySchema

    with open(os.path.join(ROOT, "deploy", "serve.yaml")) as f:
        config = yaml.safe_load(f)
    schema = ServeDeploySchema.parse_obj(config)
    app = schema.applications[0]
    module, _, attr = app.import_path.partition(":")
    builder = getattr(__import__(module, fromlist=[attr]), attr)
    opts = ServeOptions.from_dict(dict(app.args, device="cpu"))
    assert (opts.http_port, opts.grpc_port, opts.host) == (8000, 9000, "0.0.0.0")
    built = builder(dict(app.args, device="cpu", max_num_seqs=8))
    assert type(built).__name__ == "Application"


def test_options_route_engine_fields_and_refuse_unknown_ones():
    opts = ServeOptions.from_dict({"num_workers": 2, "max_num_seqs": 8, "block_size": 32})
    assert opts.engine == {"max_num_seqs": 8, "block_size": 32}
    args = opts.engine_args(gpu=False)
    assert args["device"] == "cpu" and args["num_threads"] >= 1 and args["max_num_seqs"] == 8
    with pytest.raises(ValueError, match="unknown option 'num_wrokers'"):
        ServeOptions.from_dict({"num_wrokers": 2})
    with pytest.raises(ValueError, match="num_workers"):
        ServeOptions.from_dict({"num_workers": 0})


def test_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SHOAL_API_KEY", "from-env")
    assert ServeOptions().router_options()["api_key"] == "from-env"
    assert ServeOptions(api_key="flag").router_options()["api_key"] == "flag"


@pytest.mark.slow
def test_serve_run_deploys_the_config_file(tmp_path):
    """`serve run deploy/serve.yaml` (ports and host changed for the test) serves, and Ctrl-C stops it."""
    import signal
    import subprocess
    import sys
    import time

    import httpx

    from tests.serving import free_port

    with open(os.path.join(ROOT, "deploy", "serve.yaml")) as f:
        config = yaml.safe_load(f)
    http = free_port()
    config["applications"][0]["args"].update(host="127.0.0.1", http_port=http, grpc_port=free_port(), device="cpu")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_bin = os.path.join(os.path.dirname(sys.executable), "serve")
    proc = subprocess.Popen([serve_bin, "run", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))  # fmt: skip
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

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

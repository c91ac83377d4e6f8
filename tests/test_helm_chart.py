"""The Helm chart (helm/shoal) renders, through the real Helm engine
(helm-python-sdk embeds it), manifests that Kubernetes and KubeRay accept,
and a RayService whose serveConfigV2 is the Serve config `shoal serve` builds
from the same options. No cluster and no `helm` binary are involved.

`render_serve_config(values_file)` is for other tests (the slow tier's
`serve run` of an example's config)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from shoal.cluster.app import ROUTER_RESOURCE
from shoal.cluster.options import ServeOptions
from shoal.cluster.serve_config import serve_config
from shoal.proto.lora.modules import parse_lora_modules
from shoal.workers.engine_args import EngineArgs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHART = os.path.join(ROOT, "helm", "shoal")
DEPLOY = os.path.join(ROOT, "deploy")
EXAMPLES_DIR = os.path.join(CHART, "examples")  # the example values files
CRD = os.path.join(ROOT, "tests", "k8s", "ray.io_rayservices.yaml")
# The Kubernetes version docs/deployment.md names for the chart.
KUBE_VERSION = "1.33"
RELEASE, NAMESPACE = "shoal", "llm"

# Each example values file, and the `shoal serve` command line and OTEL_*
# environment that make the same Serve config.
EXAMPLES = {
    "values-1gpu.yaml": (
        "--host 0.0.0.0 --device cuda --model /models/Llama-3.1-8B-Instruct --max-model-len 8192",
        {},
    ),
    "values-8gpu-tp2.yaml": (
        "--host 0.0.0.0 --device cuda --model /models/Qwen2.5-32B-Instruct -tp 2 "
        "--num-workers 2 --max-workers 4 --target-queue-depth 4 --routers 2 --max-model-len 16384",
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector:4317",
            "OTEL_SERVICE_NAME": "shoal",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.1",
        },
    ),
    "values-cpu-demo.yaml": (
        "--host 0.0.0.0 --device cpu --num-threads 2 --kv-cache-memory-bytes 536870912 --max-num-seqs 32 "
        "--allowed-hosts '*'",  # no API key: the Host names of a Service, not just loopback
        {},
    ),
}
# Every optional object on at once: a hostPath model, Ingress, ServiceMonitor, key, tracing.
EVERYTHING = {
    "model": {"source": "hostPath", "path": "/models/m.gguf", "hostPath": {"path": "/srv/models", "type": "Directory"}},
    "apiKeySecret": {"name": "shoal-api-key", "key": "api-key"},
    "otel": {"enabled": True, "endpoint": "http://collector:4317", "env": {"OTEL_RESOURCE_ATTRIBUTES": "env=test"}},
    "extraEnv": [{"name": "HF_HOME", "value": "/tmp/hf"}],
    "ingress": {"enabled": True, "className": "nginx", "tls": [{"secretName": "tls", "hosts": ["shoal.local"]}]},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
    "head": {"rayStartParams": {"object-store-memory": "1000000000"}},
    "rayService": {"rayClusterDeletionDelaySeconds": 300},
}
# Custom resources: checked against their CRDs, not Kubernetes' own schemas.
CRD_KINDS = {"RayService", "ServiceMonitor"}
# What every install must say (the examples do): the KubeRay operator's namespace.
REQUIRED = {"networkPolicy": {"kuberayOperator": {"namespace": "kuberay"}}}


def with_required(values: dict | None) -> dict:
    """`values` over REQUIRED (the values win)."""

    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    return merge(REQUIRED, values or {})


def load_values(name: str | None) -> dict | None:
    if name is None:
        return None
    with open(os.path.join(EXAMPLES_DIR, name)) as f:
        return yaml.safe_load(f)


def render(values: dict | None = None, required: bool = True) -> list[dict]:
    """The chart's manifests for `values` (over the chart's defaults, and
    REQUIRED unless `required` is false), parsed."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(with_required(values) if required else values, name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def rayservice(docs: list[dict]) -> dict:
    (rs,) = [d for d in docs if d["kind"] == "RayService"]
    return rs


def render_serve_config(values_file: str | None = None) -> dict:
    """The serveConfigV2 of the RayService the chart renders with a values
    file (a name in helm/shoal/examples/, or a path; None: the chart's defaults), as a dict."""
    values = None
    if values_file is not None:
        path = values_file if os.path.sep in values_file else os.path.join(EXAMPLES_DIR, values_file)
        with open(path) as f:
            values = yaml.safe_load(f)
    return yaml.safe_load(rayservice(render(values))["spec"]["serveConfigV2"])


def groups(rs: dict) -> dict[str, dict]:
    """The RayService's groups by name (the head as "head")."""
    spec = rs["spec"]["rayClusterConfig"]
    return {"head": spec["headGroupSpec"], **{g["groupName"]: g for g in spec["workerGroupSpecs"]}}


def ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]


CASES = [None, *EXAMPLES, "everything"]


def values_for(case: str | None) -> dict | None:
    return EVERYTHING if case == "everything" else load_values(case)


# ---- Helm -------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_chart_lints_without_errors_or_warnings(case):
    values = with_required(values_for(case))
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}.0", namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # 2 = warning, 3 = error


def test_rayservice_name_fits_kuberay():
    """KubeRay names the RayCluster <RayService>-xxxxx, a DNS-1035 label of at most 53 characters."""
    long = "a" * 60
    assert len(rayservice(render({"fullnameOverride": long}))["metadata"]["name"]) == 47
    with pytest.raises(helm.HelmError, match="must start with a letter"):
        render({"fullnameOverride": "1shoal"})


def test_chart_is_v2_and_defaults_to_the_project_image():
    with helm.Chart.load(CHART) as chart:
        meta = chart.metadata
        assert (meta["apiVersion"], meta["name"], meta["type"]) == ("v2", "shoal", "application")
        assert chart.schema is not None  # values.schema.json ships with it
    container = ray_container(groups(rayservice(render()))["head"])
    assert container["image"] == f"ghcr.io/shoal-project/shoal:{meta['appVersion']}"


# ---- Kubernetes and KubeRay schemas ------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_every_manifest_validates_against_kubernetes(case):
    docs = render(values_for(case))
    kinds = sorted(d["kind"] for d in docs)
    want = ["RayService", "Service", "Service"]
    if case == "everything":
        want = ["Ingress", "RayService", "Service", "Service", "Service", "ServiceMonitor"]
    elif case == "values-8gpu-tp2.yaml":
        want = ["RayService", "Service", "Service", "Service", "ServiceMonitor"]
    assert kinds == sorted(want + ["NetworkPolicy", "NetworkPolicy", "PodDisruptionBudget"])
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    # The pods KubeRay will make: each group's template, as a core PodTemplate.
    for name, group in groups(rayservice(docs)).items():
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": name},
            "template": group["template"],
        }
        kubernetes_validate.validate(pod_template, KUBE_VERSION, strict=True)


def _strict(schema):
    """The CRD schema with unknown fields refused (what `kubectl apply`'s
    default server-side field validation does), except where the CRD keeps
    unknown fields itself."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    props = schema.get("properties")
    if isinstance(props, dict) and "additionalProperties" not in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def rayservice_schema():
    with open(CRD) as f:
        (crd,) = [d for d in yaml.load_all(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if d]
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = v1["schema"]["openAPIV3Schema"]
    # metadata is an ObjectMeta the API server checks itself; its CRD schema is just `type: object`.
    return jsonschema.Draft7Validator(_strict(schema))


@pytest.mark.parametrize("case", CASES)
def test_rayservice_validates_against_the_kuberay_crd(case, rayservice_schema):
    rs = rayservice(render(values_for(case)))
    assert rs["apiVersion"] == "ray.io/v1"
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in rayservice_schema.iter_errors(rs)]
    assert errors == []


def test_the_crd_check_refuses_what_kuberay_would():
    """The check is not vacuous: a misspelled field or a wrong type is an error."""
    with open(CRD) as f:
        (crd,) = [d for d in yaml.load_all(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if d]
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    validator = jsonschema.Draft7Validator(_strict(v1["schema"]["openAPIV3Schema"]))
    rs = rayservice(render())
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert any("maxReplica" in e.message for e in validator.iter_errors(bad))
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be a string
    assert list(validator.iter_errors(bad))


# ---- The Serve config is `shoal serve`'s ------------------------------------


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_serve_config_is_what_shoal_serve_builds_from_the_same_options(name):
    from shoal.cluster.cli import build_parser

    flags, otel = EXAMPLES[name]
    expected = ServeOptions.from_cli_args(build_parser().parse_args(["serve", *shlex.split(flags)]))
    config = render_serve_config(name)
    (app,) = config["applications"]
    assert ServeOptions.from_dict(app["args"]) == expected  # loaded by the project's own config code
    assert config == serve_config(expected, otel_env=otel)  # and the whole config, entry for entry


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_files_show_that_command(name):
    """Each example's header names its `shoal serve` twin: the one tested above."""
    with open(os.path.join(EXAMPLES_DIR, name)) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#   shoal serve "))
    command = ""
    for line in lines[start:]:
        command += line.removeprefix("#").strip() + " "
        if not line.endswith("\\"):  # a shell continuation goes on to the next line
            break
    assert shlex.split(command.replace("\\ ", "")) == ["shoal", "serve", *shlex.split(EXAMPLES[name][0])]


def test_default_values_serve_the_default_model_on_every_interface():
    config = render_serve_config()
    opts = ServeOptions(host="0.0.0.0", allowed_hosts="*", engine=EngineArgs(device="cuda"))  # no key: any Host
    assert config == serve_config(opts, otel_env={})
    assert ServeOptions.from_dict(config["applications"][0]["args"]).engine.model is None  # SmolLM2 in the image


@pytest.mark.parametrize(("gpus", "device"), [(1, "cuda"), (0, "cpu")])
def test_the_device_follows_the_worker_pods_not_the_cluster_at_build_time(gpus, device):
    """Not "auto": GPU pods that have not joined when the app is built would
    make it a CPU deployment. A device set in the values wins."""
    (app,) = yaml.safe_load(rayservice(render({"workerGroup": {"gpusPerPod": gpus}}))["spec"]["serveConfigV2"])[
        "applications"
    ]
    assert app["args"]["device"] == device
    (app,) = yaml.safe_load(rayservice(render({"shoal": {"device": "cuda:0"}}))["spec"]["serveConfigV2"])[
        "applications"
    ]
    assert app["args"]["device"] == "cuda:0"


def test_print_config_prints_that_config_and_starts_nothing(capsys, monkeypatch):
    from shoal.cluster.cli import main

    flags, otel = EXAMPLES["values-8gpu-tp2.yaml"]
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    for key, value in otel.items():
        monkeypatch.setenv(key, value)
    # No model at that path here, and no Ray: --print-config loads and starts nothing.
    assert main(["serve", "--print-config", *shlex.split(flags)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == render_serve_config("values-8gpu-tp2.yaml")


def test_serve_config_round_trips_every_option_but_the_key():
    opts = ServeOptions(
        host="0.0.0.0",
        routers=3,
        routing="pow2",
        min_workers=2,
        max_workers=5,
        api_key="secret",
        engine=EngineArgs(model="/m", tensor_parallel_size=2, enable_prefix_caching=False),
    )
    config = serve_config(opts, otel_env={})
    (app,) = config["applications"]
    assert "runtime_env" not in app and "api_key" not in app["args"]  # the key never goes into a file
    assert ServeOptions.from_dict(app["args"]) == dataclasses.replace(opts, api_key=None)
    assert serve_config(ServeOptions(), otel_env={})["applications"][0]["args"] == {}  # defaults: nothing to say


def test_serve_yaml_is_in_step_with_serve_config():
    with open(os.path.join(DEPLOY, "serve.yaml")) as f:
        config = yaml.safe_load(f)
    (app,) = config["applications"]
    opts = ServeOptions.from_dict(app["args"])
    (want,) = serve_config(opts, otel_env={})["applications"]
    assert config["proxy_location"] == "Disabled"
    assert {k: app[k] for k in ("name", "route_prefix", "import_path")} == {
        k: want[k] for k in ("name", "route_prefix", "import_path")
    }
    assert ServeOptions.from_dict(want["args"]) == opts


# ---- The Ray cluster --------------------------------------------------------


def test_head_is_cpu_only_and_hosts_no_replicas():
    head = groups(rayservice(render(EVERYTHING)))["head"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert head["rayStartParams"]["object-store-memory"] == "1000000000"  # the values' own, merged
    resources = ray_container(head)["resources"]
    assert not any("gpu" in k for part in resources.values() for k in part)
    assert resources["limits"]["memory"] == "8Gi"


def test_eight_gpus_as_four_workers_of_tp2_autoscale_their_pods():
    rs = rayservice(render(load_values("values-8gpu-tp2.yaml")))
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    workers = groups(rs)["gpu-workers"]
    # One worker (2 GPUs) per pod: 1 to 4 pods, starting at 2 (num_workers).
    assert (workers["minReplicas"], workers["replicas"], workers["maxReplicas"]) == (1, 2, 4)
    limits = ray_container(workers)["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 2 and ray_container(workers)["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert workers["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert workers["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "podAntiAffinity" in workers["template"]["spec"]["affinity"]
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] == 120
    assert "idleTimeoutSeconds" not in workers  # per group only with autoscaler v2, which KubeRay would refuse
    routers = groups(rs)["routers"]
    assert routers["replicas"] == routers["minReplicas"] == routers["maxReplicas"] == 2


@pytest.mark.parametrize(
    ("gpus", "tp", "workers", "max_workers", "pods"),
    [(8, 2, 4, None, (1, 1, 1)), (8, 2, 5, None, (2, 2, 2)), (4, 1, 1, 10, (1, 1, 3)), (0, 1, 3, None, (3, 3, 3))],
)
def test_worker_pods_hold_gpus_over_tp_workers_each(gpus, tp, workers, max_workers, pods):
    shoal = {"tensor_parallel_size": tp, "num_workers": workers, "max_workers": max_workers}
    rs = rayservice(render({"workerGroup": {"gpusPerPod": gpus}, "shoal": shoal}))
    (group,) = [g for name, g in groups(rs).items() if name.endswith("-workers")]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == pods
    gpu = ray_container(group)["resources"]["limits"].get("nvidia.com/gpu")
    assert gpu == (gpus or None)
    assert ("enableInTreeAutoscaling" in rs["spec"]["rayClusterConfig"]) == (max_workers is not None)


def test_routers_land_on_their_own_pods_behind_the_services():
    docs = render(EVERYTHING)
    rs = rayservice(docs)
    routers = groups(rs)["routers"]
    # The custom resource the Router deployment asks for, in KubeRay's quoting
    # (it becomes `ray start --resources="{\"shoal_router\":1}"` in a shell).
    assert routers["rayStartParams"]["resources"] == '"{\\"shoal_router\\":1}"'
    assert json.loads(json.loads(routers["rayStartParams"]["resources"])) == {ROUTER_RESOURCE: 1}
    assert routers["rayStartParams"]["num-cpus"] == "0"
    labels = routers["template"]["metadata"]["labels"]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    http, grpc = services[f"{RELEASE}"], services[f"{RELEASE}-grpc"]
    for svc in (http, grpc):
        assert svc["spec"]["selector"].items() <= labels.items()
        for name, group in groups(rs).items():  # ... and no other group's pods
            if name != "routers":
                assert not svc["spec"]["selector"].items() <= group["template"]["metadata"]["labels"].items()
    assert http["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}
    ]
    assert grpc["spec"]["ports"] == [
        {"name": "grpc", "port": 9000, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}
    ]
    container = ray_container(routers)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["http"], ports["grpc"]) == (8000, 9000)
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/api/local_raylet_healthz", "port": 52365}
    # Long enough for the preStop pause and the streams' drain (drain_timeout_s, default 30).
    assert routers["template"]["spec"]["terminationGracePeriodSeconds"] >= 30 + 5


def test_pods_tell_build_app_that_routers_and_gpus_come_from_the_chart():
    """The app is built as soon as the head is up, before the router and GPU
    pods join: SHOAL_KUBERAY=1 on every pod sets ServeOptions.nodes_join_later,
    which makes build_app place routers on the shoal_router pods and skip
    counting GPUs that have not joined yet."""
    from shoal.cluster.app import cluster_has_router_nodes

    for name, group in groups(rayservice(render(load_values("values-8gpu-tp2.yaml")))).items():
        assert {"name": "SHOAL_KUBERAY", "value": "1"} in ray_container(group)["env"], name
    code = "from shoal.cluster.options import ServeOptions; print(ServeOptions().nodes_join_later)"
    for env, expected in (("0", "False"), ("1", "True")):
        run = subprocess.run(
            [sys.executable, "-c", code],
            env=os.environ | {"SHOAL_KUBERAY": env},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert run.stdout.strip() == expected
    assert not cluster_has_router_nodes()  # outside Ray, no marked node
    assert cluster_has_router_nodes(nodes_join_later=True)


def test_every_ray_container_has_probes_of_its_own():
    """KubeRay injects wget probes where a container has none (and a Serve-proxy
    check on workers, which shoal does not run): the chart sets them all."""
    for name, group in groups(rayservice(render())).items():
        container = ray_container(group)
        assert "httpGet" in container["readinessProbe"] and "httpGet" in container["livenessProbe"], name


def test_api_key_reaches_the_routers_from_its_secret_only():
    rs = rayservice(render(EVERYTHING))
    assert "shoal-api-key" not in rs["spec"]["serveConfigV2"] and "api_key" not in rs["spec"]["serveConfigV2"]
    for name, group in groups(rs).items():  # the routers check it; the head and the workers never hold it
        env = {e["name"]: e for e in ray_container(group)["env"]}
        if name != "routers":
            assert "SHOAL_API_KEY" not in env, name
            continue
        assert env["SHOAL_API_KEY"] == {
            "name": "SHOAL_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "shoal-api-key", "key": "api-key"}},
        }
    for group in groups(rayservice(render())).values():  # no Secret named: no key, no variable
        assert "SHOAL_API_KEY" not in {e["name"] for e in ray_container(group).get("env", [])}


def test_otel_settings_go_on_the_pods_and_into_the_runtime_env():
    rs = rayservice(render(EVERYTHING))
    want = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_SERVICE_NAME": "shoal",
        "OTEL_RESOURCE_ATTRIBUTES": "env=test",
    }
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    assert app["runtime_env"] == {"env_vars": want}
    for group in groups(rs).values():
        env = {e["name"]: e.get("value") for e in ray_container(group)["env"]}
        assert {k: v for k, v in env.items() if k.startswith("OTEL_")} == want
        assert env["HF_HOME"] == "/tmp/hf"  # extraEnv
    (app,) = render_serve_config()["applications"]
    assert "runtime_env" not in app  # tracing off: nothing set


@pytest.mark.parametrize(
    ("model", "volume"),
    [
        (
            {"source": "pvc", "path": "/models/m", "pvc": {"claimName": "weights"}},
            {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
        ),
        (
            {"source": "hostPath", "path": "/models/m", "hostPath": {"path": "/srv/m"}},
            {"hostPath": {"path": "/srv/m", "type": "Directory"}},
        ),
        ({"source": "image", "path": "/opt/models/m"}, None),
    ],
)
def test_model_comes_from_a_pvc_a_host_path_or_the_image(model, volume):
    rs = rayservice(render({"model": model}))
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    assert app["args"]["model"] == model["path"]
    for group in groups(rs).values():  # the app is built, and the tokenizer read, on any of them
        spec = group["template"]["spec"]
        volumes = [v for v in spec["volumes"] if v["name"] == "model"]
        mounts = [m for m in ray_container(group)["volumeMounts"] if m["name"] == "model"]
        if volume is None:
            assert volumes == mounts == []
        else:
            assert volumes == [{"name": "model", **volume}]
            assert mounts == [{"name": "model", "mountPath": "/models", "readOnly": True}]


def test_values_a_schema_cannot_compare_are_refused_by_the_templates():
    with pytest.raises(helm.HelmError, match=r"model.path \(/data/m\) must lie under model.mountPath \(/models\)"):
        render({"model": {"source": "pvc", "path": "/data/m", "pvc": {"claimName": "weights"}}})
    with pytest.raises(helm.HelmError, match=r"shoal.max_workers \(2\) must be >= shoal.min_workers \(3\)"):
        render({"shoal": {"max_workers": 2, "min_workers": 3}})


def test_optional_ingress_and_service_monitor():
    docs = render(EVERYTHING)
    (ingress,) = [d for d in docs if d["kind"] == "Ingress"]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": RELEASE, "port": {"name": "http"}}
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    ports = {e["port"]: e["path"] for e in monitor["spec"]["endpoints"]}
    assert ports == {"http": "/metrics", "ray-metrics": "/metrics"}
    services = [d for d in docs if d["kind"] == "Service"]
    for endpoint_port in ports:  # each endpoint names a port of a Service the monitor selects
        assert any(
            p["name"] == endpoint_port
            for s in services
            for p in s["spec"]["ports"]
            if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
        )
    (metrics,) = [s for s in services if s["metadata"]["name"].endswith("-ray-metrics")]
    assert metrics["spec"]["ports"][0]["port"] == 8080
    assert metrics["spec"]["selector"]["app.kubernetes.io/part-of"] == "shoal"  # every Ray pod of the release


def test_notes_say_how_to_reach_the_api_and_the_status_page():
    with helm.Chart.load(CHART) as chart:
        notes = chart.render(with_required(EVERYTHING), name=RELEASE, namespace=NAMESPACE)["shoal/templates/NOTES.txt"]
    assert "curl -s http://127.0.0.1:8000/v1/chat/completions" in notes
    assert "Authorization: Bearer $SHOAL_API_KEY" in notes
    assert "grpcurl -plaintext" in notes and "127.0.0.1:9000 shoal.v1.Shoal/GetModelInfo" in notes
    assert "Status page" in notes and "http://127.0.0.1:8000/" in notes
    assert f"port-forward svc/{RELEASE}-grpc 9000:9000" in notes


# ---- Locked down -------------------------------------------------------------

# Ray's control plane: whoever reaches the GCS, the dashboard (Jobs API) or the client server runs code there.
RAY_PORTS = {6379, 8265, 10001, "gcs-server", "dashboard", "client"}
OUTSIDE = {"namespace": {"kubernetes.io/metadata.name": "elsewhere"}, "labels": {"app": "curious"}}
OPERATOR = {
    "namespace": {"kubernetes.io/metadata.name": "kuberay"},
    "labels": {"app.kubernetes.io/name": "kuberay-operator"},
}
# A pod labelled like the operator in another namespace: anyone may make one.
OPERATOR_LOOKALIKE = {**OPERATOR, "namespace": {"kubernetes.io/metadata.name": "elsewhere"}}


def test_ray_token_authentication_is_on_with_the_token_from_a_secret(rayservice_schema):
    cluster = rayservice(render())["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}  # KubeRay makes the Secret and sets RAY_AUTH_TOKEN from it
    assert int(cluster["rayVersion"].split(".")[1]) >= 52  # token auth needs Ray 2.52
    rs = rayservice(render({"rayAuth": {"secretName": "ray-token"}}))
    assert rs["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    assert list(rayservice_schema.iter_errors(rs)) == []
    assert "authOptions" not in rayservice(render({"rayAuth": {"enabled": False}}))["spec"]["rayClusterConfig"]


def test_the_pinned_ray_is_the_charts_and_has_the_cve_fixes():
    import tomllib

    import ray

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("ray[")]
    version = pin.split("==")[1]
    assert tuple(map(int, version.split("."))) >= (2, 54)  # CVE-2025-62593 (2.52), CVE-2026-27482 (2.54)
    assert version == ray.__version__ == rayservice(render())["spec"]["rayClusterConfig"]["rayVersion"]


@pytest.mark.parametrize("case", CASES)
def test_no_service_carries_rays_ports_and_the_head_keeps_its_own_internal(case):
    docs = render(values_for(case))
    for svc in (d for d in docs if d["kind"] == "Service"):
        for port in svc["spec"]["ports"]:
            assert not {port["port"], port["targetPort"], port["name"]} & RAY_PORTS, svc["metadata"]["name"]
    for ingress in (d for d in docs if d["kind"] == "Ingress"):
        backends = {p["backend"]["service"]["name"] for r in ingress["spec"]["rules"] for p in r["http"]["paths"]}
        assert backends == {RELEASE}
    rs = rayservice(docs)
    head = groups(rs)["head"]
    # KubeRay's head Service carries the head container's ports: cluster-internal, and no Ray Client server.
    assert head["serviceType"] == "ClusterIP" and "headService" not in head
    assert {p["name"] for p in ray_container(head)["ports"]} == {"gcs-server", "dashboard", "metrics"}
    for name, group in groups(rs).items():
        if name != "head":
            assert not {p["name"] for p in ray_container(group)["ports"]} & RAY_PORTS, name


def _selects(selector: dict, labels: dict) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items() and not selector.get("matchExpressions")


def _admitted(docs: list[dict], pod: dict, port: str, peer: dict) -> bool:
    """NetworkPolicy's rules for ingress to `pod` (its template) on a named
    container port from `peer` (its namespace's labels, None for the release's
    own namespace, and its pod labels)."""
    labels = pod["metadata"]["labels"]
    policies = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy" and _selects(d["spec"]["podSelector"], labels)]
    if not any("Ingress" in p["policyTypes"] for p in policies):
        return True  # not isolated
    for rule in (rule for policy in policies for rule in policy.get("ingress", [])):
        if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
            continue
        for source in rule.get("from", [{}]):
            if source == {}:  # no `from`: anyone
                return True
            if "namespaceSelector" in source:
                theirs = peer["namespace"]
                in_namespace = theirs is not None and _selects(source["namespaceSelector"], theirs)
            else:  # a bare podSelector: this namespace only
                in_namespace = peer["namespace"] is None
            if in_namespace and _selects(source.get("podSelector", {}), peer["labels"]):
                return True
    return False


@pytest.mark.parametrize("monitor", [False, True])
def test_network_policy_admits_from_outside_only_the_routers_api(monitor):
    docs = render({"serviceMonitor": {"enabled": monitor}})
    pods = {name: g["template"] for name, g in groups(rayservice(docs)).items()}
    for name, pod in pods.items():
        for port in [p["name"] for p in pod["spec"]["containers"][0]["ports"]] + ["raylet-or-worker-port"]:
            for other in pods.values():  # the release's own pods reach everything
                assert _admitted(docs, pod, port, {"namespace": None, "labels": other["metadata"]["labels"]})
            from_outside = _admitted(docs, pod, port, OUTSIDE)
            want = (name == "routers" and port in ("http", "grpc")) or (monitor and port == "metrics")
            assert from_outside == want, (name, port)
            assert _admitted(docs, pod, port, OPERATOR) == (want or (name == "head" and port == "dashboard"))
            assert _admitted(docs, pod, port, OPERATOR_LOOKALIKE) == want
    apis = render({"networkPolicy": {"apiFrom": [{"namespaceSelector": {"matchLabels": {"team": "edge"}}}]}})
    router = groups(rayservice(apis))["routers"]["template"]
    assert not _admitted(apis, router, "http", OUTSIDE)
    assert _admitted(apis, router, "http", {"namespace": {"team": "edge"}, "labels": {}})
    assert not [d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]


def test_the_network_policy_names_the_operators_namespace():
    np = [d for d in render() if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-ray")]
    (operator,) = [r for r in np[0]["spec"]["ingress"] if r.get("ports") == [{"port": "dashboard", "protocol": "TCP"}]]
    assert operator["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
        }
    ]
    # Required: no default admits the operator's label from any namespace.
    message = "at '/networkPolicy/kuberayOperator/namespace': minLength: got 0, want 1"
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        render(required=False)
    with pytest.raises(helm.HelmValuesError, match="additional properties 'namespaceSelector' not allowed"):
        render({"networkPolicy": {"kuberayOperator": {"namespaceSelector": {}}}})
    with pytest.raises(helm.HelmValuesError, match="/networkPolicy/kuberayOperator/namespace"):
        render({"networkPolicy": {"kuberayOperator": {"namespace": "Not A Namespace"}}})
    # Without the NetworkPolicies nothing needs naming.
    assert not [
        d for d in render({"networkPolicy": {"enabled": False}}, required=False) if d["kind"] == "NetworkPolicy"
    ]
    for name in EXAMPLES:  # each example says where its operator runs
        assert load_values(name)["networkPolicy"]["kuberayOperator"]["namespace"] == "kuberay-system"


@pytest.mark.parametrize(
    "exposed",
    [
        {"service": {"type": "LoadBalancer"}},
        {"service": {"type": "NodePort"}},
        {"ingress": {"enabled": True}},
        {"shoal": {"enable_lora": True, "allow_runtime_lora_updating": True}},  # clients name files workers read
    ],
)
def test_an_exposed_api_or_runtime_lora_updates_need_an_api_key(exposed):
    with pytest.raises(helm.HelmValuesError, match=re.escape("at '/apiKeySecret/name': minLength: got 0, want 1")):
        render(exposed)
    docs = render({**exposed, "apiKeySecret": {"name": "shoal-api-key"}})
    env = {e["name"] for e in ray_container(groups(rayservice(docs))["routers"])["env"]}
    assert "SHOAL_API_KEY" in env
    render({"service": {"type": "ClusterIP"}})  # inside the cluster only, the NetworkPolicy in front: allowed


TLS = {"tls": {"secretName": "shoal-tls"}}


@pytest.mark.parametrize(("client_auth", "cert_reqs"), [("none", 0), ("optional", 1), ("required", 2)])
def test_tls_from_a_secret_on_the_routers_ports(client_auth, cert_reqs, rayservice_schema):
    from shoal.cluster.cli import build_parser

    values = {"tls": {"secretName": "shoal-tls", "clientAuth": client_auth}}
    report = helm.lint(
        CHART, with_required(values), strict=True, kube_version=f"v{KUBE_VERSION}.0", namespace=NAMESPACE
    )
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    docs = render(values)
    rs = rayservice(docs)
    assert list(rayservice_schema.iter_errors(rs)) == []
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "routers"}}
    kubernetes_validate.validate({**pod, "template": groups(rs)["routers"]["template"]}, KUBE_VERSION, strict=True)
    # The routers' args: shoal serve's --ssl-* flags, read from the mounted Secret.
    flags = "--host 0.0.0.0 --device cuda --allowed-hosts * "
    flags += "--ssl-certfile /etc/shoal/tls/tls.crt --ssl-keyfile /etc/shoal/tls/tls.key"
    if cert_reqs:
        flags += f" --ssl-ca-certs /etc/shoal/tls/ca.crt --ssl-cert-reqs {cert_reqs}"
    expected = ServeOptions.from_cli_args(build_parser().parse_args(["serve", *flags.split()]))
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert config == serve_config(expected, otel_env={})
    assert ServeOptions.from_dict(config["applications"][0]["args"]) == expected
    # The Secret in the router pods alone (the key never on the head or the workers).
    for name, group in groups(rs).items():
        spec, container = group["template"]["spec"], ray_container(group)
        volumes = [v for v in spec["volumes"] if v["name"] == "tls"]
        mounts = [m for m in container["volumeMounts"] if m["name"] == "tls"]
        if name != "routers":
            assert volumes == mounts == [], name
            continue
        assert volumes == [{"name": "tls", "secret": {"secretName": "shoal-tls", "defaultMode": 0o440}}]
        assert mounts == [{"name": "tls", "mountPath": "/etc/shoal/tls", "readOnly": True}]
        probe = container["readinessProbe"]
        if client_auth == "required":  # the kubelet has no client certificate: the port answers
            assert probe["tcpSocket"] == {"port": "http"} and "httpGet" not in probe
        else:
            assert probe["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    (http,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == RELEASE]
    assert http["spec"]["ports"][0]["appProtocol"] == "https"
    with helm.Chart.load(CHART) as chart:
        notes = chart.render(with_required(values), name=RELEASE, namespace=NAMESPACE)["shoal/templates/NOTES.txt"]
    assert "curl -s -k https://127.0.0.1:8000/v1/chat/completions" in notes
    assert "grpcurl -insecure 127.0.0.1:9000" in notes


def test_without_tls_the_routers_speak_plain_http_and_grpc():
    docs = render()
    rs = rayservice(docs)
    assert "ssl_" not in rs["spec"]["serveConfigV2"]
    router = ray_container(groups(rs)["routers"])
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert not [m for m in router["volumeMounts"] if m["name"] == "tls"]
    monitor = render({**TLS, "serviceMonitor": {"enabled": True}})
    (sm,) = [d for d in monitor if d["kind"] == "ServiceMonitor"]
    assert sm["spec"]["endpoints"][0]["scheme"] == "https"  # the routers' /metrics, under TLS
    # The files are the chart's to set, from tls.
    with pytest.raises(helm.HelmValuesError, match="at '/shoal/ssl_certfile': false schema"):
        render({"shoal": {"ssl_certfile": "/x.crt"}})
    with pytest.raises(helm.HelmValuesError, match="/tls/clientAuth"):
        render({"tls": {"secretName": "s", "clientAuth": "sometimes"}})


@pytest.mark.parametrize("case", [None, "values-8gpu-tp2.yaml"])
def test_pods_hold_no_api_token_and_write_only_to_their_emptydirs(case):
    rs = rayservice(render(values_for(case)))
    autoscaling = case is not None
    for name, group in groups(rs).items():
        spec = group["template"]["spec"]
        container = ray_container(group)
        assert spec["automountServiceAccountToken"] is False, name
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        for path in ("/tmp", "/dev/shm", "/home/shoal"):  # Ray's session and object store; torch's and Triton's caches
            assert "emptyDir" in mounts[path], (name, path)
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
        assert "/var/run/secrets/kubernetes.io/serviceaccount" not in mounts  # Serve's code never sees a token
        assert ("kube-api-access" in volumes) == (autoscaling and name == "head"), name
    cluster = rs["spec"]["rayClusterConfig"]
    if autoscaling:  # only the autoscaler sidecar patches the RayCluster: it alone mounts the projected token
        scaler = cluster["autoscalerOptions"]
        assert {m["mountPath"]: m["name"] for m in scaler["volumeMounts"]} == {
            "/tmp": "tmp",
            "/var/run/secrets/kubernetes.io/serviceaccount": "kube-api-access",
        }
        assert scaler["securityContext"]["readOnlyRootFilesystem"] is True
        sources = groups(rs)["head"]["template"]["spec"]["volumes"][-1]["projected"]["sources"]
        assert sources[0]["serviceAccountToken"]["path"] == "token"
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:  # HOME of the image's user is what the chart mounts
        assert "\nWORKDIR /home/shoal\n" in f.read()


def test_router_pods_have_a_disruption_budget():
    docs = render(load_values("values-8gpu-tp2.yaml"))
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    for name, group in groups(rayservice(docs)).items():
        assert _selects(pdb["spec"]["selector"], group["template"]["metadata"]["labels"]) == (name == "routers")
    (pdb,) = [
        d
        for d in render({"routerGroup": {"podDisruptionBudget": {"minAvailable": 1}}})
        if d["kind"] == "PodDisruptionBudget"
    ]
    assert pdb["spec"] == {"minAvailable": 1, "selector": pdb["spec"]["selector"]}
    assert not [
        d
        for d in render({"routerGroup": {"podDisruptionBudget": {"enabled": False}}})
        if d["kind"] == "PodDisruptionBudget"
    ]


# ---- values.schema.json -----------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        # negative replicas
        ({"shoal": {"num_workers": -1}}, "at '/shoal/num_workers': minimum: got -1, want 1"),
        ({"shoal": {"routers": -2}}, "at '/shoal/routers': minimum: got -2, want 1"),
        ({"shoal": {"max_workers": 4, "min_workers": -1}}, "at '/shoal/min_workers': minimum: got -1, want 1"),
        # a tensor-parallel size that does not divide the GPUs per pod
        (
            {"workerGroup": {"gpusPerPod": 4}, "shoal": {"tensor_parallel_size": 3}},
            "at '/shoal/tensor_parallel_size': value must be one of 1, 2, 4",
        ),
        (
            {"workerGroup": {"gpusPerPod": 1}, "shoal": {"tensor_parallel_size": 2}},
            "at '/shoal/tensor_parallel_size': value must be 1",
        ),
        # no model
        ({"model": {"source": "pvc", "pvc": {"claimName": "weights"}}}, "at '/model': missing property 'path'"),
        ({"model": {"source": "hostPath", "path": ""}}, "at '/model/path': minLength: got 0, want 2"),
        ({"model": {"source": "pvc", "path": "/models/m"}}, "at '/model/pvc/claimName': minLength: got 0, want 1"),
        # an API key inline rather than from a Secret
        ({"apiKey": "sk-123"}, "at '/apiKey': false schema"),
        ({"shoal": {"api_key": "sk-123"}}, "at '/shoal/api_key': false schema"),
        (
            {"apiKeySecret": {"name": "s", "value": "sk-123"}},
            "at '/apiKeySecret': additional properties 'value' not allowed",
        ),
        ({"extraEnv": [{"name": "SHOAL_API_KEY", "value": "sk-123"}]}, "at '/extraEnv/0/name': 'not' failed"),
        # and typos
        ({"shoal": {"num_wrokers": 2}}, "at '/shoal': additional properties 'num_wrokers' not allowed"),
        ({"shoal": {"min_workers": 2}}, "at '/shoal': missing property 'max_workers'"),
    ],
)
def test_schema_refuses_bad_values_naming_the_field(values, message):
    with pytest.raises(helm.HelmValuesError) as err:
        render(values)
    assert message in str(err.value)


def test_schema_and_values_list_every_shoal_serve_option():
    """values.yaml's `shoal` has one key per ServeOptions/EngineArgs field (but the
    three the chart sets), and the schema types each one: a new option fails here."""
    fields = {f.name for f in dataclasses.fields(ServeOptions)} - {"engine"}
    fields |= {f.name for f in dataclasses.fields(EngineArgs)}
    chart_set = {"host", "model", "api_key", "nodes_join_later", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs"}
    chart_set |= {"ssl_cert_reqs"}  # the TLS files: from `tls`
    chart_set |= {"kv_offload_disk_path"}  # from `kvDisk`
    with open(os.path.join(CHART, "values.schema.json")) as f:
        schema = json.load(f)
    props = schema["properties"]["shoal"]["properties"]
    assert set(props) == fields
    assert all(props[k] is False for k in chart_set)
    with open(os.path.join(CHART, "values.yaml")) as f:
        values = yaml.safe_load(f)
    assert set(values["shoal"]) == fields - chart_set
    assert all(v is None for v in values["shoal"].values())  # shoal's own defaults, never pinned here


def test_the_kv_disk_tier_is_an_emptydir_or_a_claim_on_the_worker_pods_alone():
    values = load_values("values-cpu-demo.yaml")
    values["kvDisk"] = {"enabled": True, "mountPath": "/var/lib/shoal/kv", "sizeLimit": "20Gi"}
    docs = render(values)
    rs = rayservice(docs)
    for name, group in groups(rs).items():
        spec = group["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in ray_container(group)["volumeMounts"]}
        if name in ("head", "routers"):
            assert "kv-disk" not in volumes and "/var/lib/shoal/kv" not in mounts, name
        else:
            assert volumes["kv-disk"] == {"name": "kv-disk", "emptyDir": {"sizeLimit": "20Gi"}}, name
            assert mounts["/var/lib/shoal/kv"] == "kv-disk", name
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert config["applications"][0]["args"]["kv_offload_disk_path"] == "/var/lib/shoal/kv"
    off = yaml.safe_load(rayservice(render(load_values("values-cpu-demo.yaml")))["spec"]["serveConfigV2"])
    assert "kv_offload_disk_path" not in off["applications"][0]["args"]

    # A claim instead: the same mount, the blocks on a volume that outlives the pods.
    values["kvDisk"] = {"enabled": True, "mountPath": "/var/lib/shoal/kv", "claimName": "shoal-kv"}
    for name, group in groups(rayservice(render(values))).items():
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        if name not in ("head", "routers"):
            assert volumes["kv-disk"] == {"name": "kv-disk", "persistentVolumeClaim": {"claimName": "shoal-kv"}}, name


@pytest.mark.slow
def test_the_cpu_demos_serve_config_serves_under_serve_run(tmp_path):
    """The serveConfigV2 the chart renders for the CPU demo, as KubeRay would
    hand it to Serve, deployed with `serve run` on a local Ray cluster."""
    from test_serve_config import serve_run_and_complete

    serve_run_and_complete(render_serve_config("values-cpu-demo.yaml"), tmp_path)


def test_lora_modules_and_the_runtime_gate_reach_the_serve_config():
    modules = ["sql=/adapters/sql", {"name": "chat", "path": "/adapters/chat", "base_model_name": "m"}]
    shoal = {"enable_lora": True, "max_loras": 4, "lora_modules": modules, "allow_runtime_lora_updating": True}
    values = {"shoal": shoal, "apiKeySecret": {"name": "shoal-api-key"}}  # runtime updates need a key
    (app,) = yaml.safe_load(rayservice(render(values))["spec"]["serveConfigV2"])["applications"]
    opts = ServeOptions.from_dict(app["args"])
    assert opts.allow_runtime_lora_updating and opts.engine.enable_lora and opts.engine.max_loras == 4
    assert [(m.name, m.path, m.base_model_name) for m in parse_lora_modules(opts.engine.lora_modules)] == [
        ("sql", "/adapters/sql", None),
        ("chat", "/adapters/chat", "m"),
    ]
    with pytest.raises(helm.HelmValuesError, match="lora_modules/0"):
        render({"shoal": {"enable_lora": True, "lora_modules": ["no-path-given"]}})

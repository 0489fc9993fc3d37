"""The Helm chart (deploy/helm/canvas), rendered by Helm itself (its Go SDK, through the
`helm-python-sdk` wheel): lint-clean; every manifest valid against the Kubernetes schemas of the
oldest supported and the newest release (`kubernetes-validate`, offline), custom resources
against tests/deploy/crd_schemas.py; and wired to what Canvas really does: probes on /health
and /ready, a grace period longer than the drain, the API key from a required Secret, and
autoscaling and gateway routing on metric names that Canvas' /metrics exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.crd_schemas import CUSTOM_RESOURCES, ENDPOINT_PICKER_CONFIG
from tests.server.conftest import make_fake_server

helm = pytest.importorskip(
    "helm_python", reason="the chart tests need Helm's SDK: pip install -e '.[dev]'"
)
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate",
    reason="the chart tests need kubernetes-validate: pip install -e '.[dev]'",
)

DEPLOY = Path(__file__).parents[2] / "deploy"
CHART = DEPLOY / "helm" / "canvas"
OLDEST_KUBERNETES = "1.29"  # Chart.yaml's kubeVersion
EVERYTHING = {
    "serviceMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "grafanaDashboard": {"enabled": True},
    "autoscaling": {"enabled": True},
    "inferenceGateway": {"enabled": True, "gateway": {"className": "example-gateway-class"}},
    "apiKey": {"value": "sekrit-key"},
    "model": {"existingClaim": ""},
}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart's manifests for release `demo` in namespace `llm`."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values or {}, name="demo", namespace="llm")
    docs = []
    for name, text in sorted(files.items()):
        if name.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return doc


def canvas_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(docs, "Deployment", "demo-canvas")["spec"]["template"]["spec"]["containers"]
    return container


def exported_metrics() -> set[str]:
    """The metric names a Canvas server's /metrics exports (over the fake engine)."""
    server = make_fake_server()
    with server.client:
        text = server.client.get("/metrics").text
    return set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))


def validate(doc: dict[str, Any], version: str) -> None:
    schema = CUSTOM_RESOURCES.get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        jsonschema.validate(doc, schema)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_chart_is_lint_clean():
    report = helm.lint(str(CHART))
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] > 1] == []  # infos only


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("values", [{}, EVERYTHING], ids=["defaults", "everything"])
def test_every_manifest_matches_its_schema(values, version):
    docs = render(values)
    for doc in docs:
        validate(doc, version)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= kinds
    if values:
        assert set(k for _, k in CUSTOM_RESOURCES) <= kinds  # every custom resource was checked
        assert {"HorizontalPodAutoscaler", "Secret", "PersistentVolumeClaim", "Role"} <= kinds


def test_the_schemas_catch_a_broken_manifest():
    docs = render(EVERYTHING)
    service = one(docs, "Service", "demo-canvas")
    service["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'integer'"):
        validate(service, OLDEST_KUBERNETES)
    pool = one(docs, "InferencePool")
    pool["spec"]["targetPorts"] = []
    with pytest.raises(jsonschema.ValidationError, match="should be non-empty|too short"):
        validate(pool, OLDEST_KUBERNETES)


def test_the_plain_manifest_matches_the_kubernetes_schemas():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "canvas.yaml").read_text()) if d]
    assert {d["kind"] for d in docs} == {"Deployment", "Service"}
    for doc in docs:
        validate(doc, OLDEST_KUBERNETES)


def test_probes_watch_health_and_readiness_on_the_http_port():
    container = canvas_container(render())
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    for probe in ("readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/ready", "port": "http"}


@pytest.mark.parametrize("drain", [0, 30, 120])
def test_the_grace_period_covers_the_pre_stop_sleep_and_the_whole_drain(drain):
    docs = render({"drainSeconds": drain, "preStopSleepSeconds": 7})
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[args.index("--drain-seconds") + 1] == str(drain)
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]
    assert pod["terminationGracePeriodSeconds"] > drain + 7


def test_each_replica_takes_one_gpu_and_reads_the_model_volume():
    docs = render()
    container = canvas_container(docs)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = container["args"]
    assert args[args.index("--model") + 1] == "/model"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "model"]
    assert mount == {"name": "model", "mountPath": "/model", "readOnly": True}
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert volume["persistentVolumeClaim"]["claimName"] == "diffusiongemma-weights"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert "PersistentVolumeClaim" not in {d["kind"] for d in docs}  # an existing claim


TP4 = {"parallelism": {"tensorParallelSize": 4, "shmSize": "4Gi"}}


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_a_tensor_parallel_pod_takes_a_gpu_per_rank_and_a_memory_backed_dev_shm(version):
    docs = render(TP4)
    for doc in docs:
        validate(doc, version)
    container = canvas_container(docs)
    args = container["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["resources"]
    for part in ("requests", "limits"):
        assert container["resources"][part] == {**defaults[part], "nvidia.com/gpu": 4}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    one_gpu = canvas_container(render())
    assert "--tensor-parallel-size" not in one_gpu["args"]
    assert one_gpu["resources"] == defaults
    assert "/dev/shm" not in {m["mountPath"] for m in one_gpu["volumeMounts"]}


HUB = {"hubId": "google/diffusiongemma-26B-A4B-it@main", "hfToken": {"existingSecret": "hf"}}


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_a_hub_id_is_downloaded_into_a_kept_cache_with_hf_token_from_a_secret(version):
    docs = render({"model": HUB})
    for doc in docs:
        validate(doc, version)
    container = canvas_container(docs)
    args = container["args"]
    assert args[args.index("--model") + 1] == HUB["hubId"]
    assert args[args.index("--download-dir") + 1] == "/hub-cache"
    names = args[args.index("--served-model-name") + 1 : args.index("--drain-seconds")]
    assert names == ["google/diffusiongemma-26B-A4B-it", "diffusiongemma-26b-a4b-it"]
    token = next(e for e in container["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token", "optional": False}
    assert container["volumeMounts"][0] == {"name": "hub-cache", "mountPath": "/hub-cache"}
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    claim = one(docs, "PersistentVolumeClaim")  # the download cache's, not the model's
    (volume,) = [v for v in pod["volumes"] if v["name"] == "hub-cache"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "model" not in {v["name"] for v in pod["volumes"]}
    local = canvas_container(render())["startupProbe"]["failureThreshold"]
    assert container["startupProbe"]["failureThreshold"] > local  # the download comes first
    ephemeral = render({"model": {**HUB, "downloadCache": {"enabled": False}}})
    (volume,) = [
        v
        for v in one(ephemeral, "Deployment")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "hub-cache"
    ]
    assert volume == {"name": "hub-cache", "emptyDir": {}}
    assert "PersistentVolumeClaim" not in {d["kind"] for d in ephemeral}


def api_key_env(container: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in container.get("env", []) if e["name"] == "CANVAS_API_KEY"]


def test_the_api_key_comes_from_a_required_secret():
    (env,) = api_key_env(canvas_container(render()))
    assert env["name"] == "CANVAS_API_KEY"
    assert env["valueFrom"]["secretKeyRef"] == {
        "name": "canvas-api-key",
        "key": "key",
        "optional": False,
    }
    docs = render({"apiKey": {"value": "sekrit-key"}})
    (env,) = api_key_env(canvas_container(docs))
    secret = one(docs, "Secret")
    assert env["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert secret["stringData"] == {"key": "sekrit-key"}
    assert not api_key_env(canvas_container(render({"apiKey": {"enabled": False}})))


@pytest.mark.parametrize(
    "values", [{}, {"apiKey": {"enabled": False}}, {"env": [{"name": "A", "value": "1"}]}]
)
def test_compiled_triton_kernels_are_kept_on_the_cache_volume(values):
    """TRITON_CACHE_DIR (Canvas' default too: $CANVAS_CACHE/triton) lies on the cache volume,
    which outlives a container restart, so a restarted container's warm-up compiles nothing."""
    docs = render(values)
    container = canvas_container(docs)
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert env["TRITON_CACHE_DIR"] == mounts["cache"] + "/canvas/triton"
    assert all(env.get(e["name"]) == e["value"] for e in values.get("env", []))
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "cache"]
    assert "emptyDir" in volume


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"drainSeconds": -1}, "/drainSeconds"),
        ({"apiKey": {"existingSecret": "", "value": ""}}, "/apiKey"),
        ({"apiKey": {"value": "two words"}}, "/apiKey/value"),
        ({"model": {"hubId": "../models/gemma"}}, "/model/hubId"),
        ({"inferenceGateway": {"endpointPicker": {"failureMode": "Maybe"}}}, "/failureMode"),
        ({"parallelism": {"tensorParallelSize": 0}}, "/parallelism/tensorParallelSize"),
        ({"parallelism": {"shmSize": "lots"}}, "/parallelism/shmSize"),
    ],
)
def test_bad_values_are_refused_naming_the_value(values, fragment):
    with pytest.raises(Exception, match=re.escape(fragment)):
        render(values)


def test_the_service_monitor_scrapes_metrics_on_the_services_port():
    docs = render({"serviceMonitor": {"enabled": True}})
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service", "demo-canvas")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_the_hpa_scales_on_the_queue_length_that_canvas_exports():
    docs = render({"autoscaling": {"enabled": True}})
    hpa, deployment = one(docs, "HorizontalPodAutoscaler"), one(docs, "Deployment")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    # prometheus-adapter renames the series Canvas exports to the name the HPA asks for.
    adapter = yaml.safe_load((DEPLOY / "helm" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    series = rule["seriesQuery"].split("{")[0]
    assert series == "vllm:num_requests_waiting" and series in exported_metrics()
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert metric["pods"]["metric"]["name"] == served


def test_the_inference_pool_routes_to_canvas_pods_by_metrics_canvas_exports():
    docs = render(EVERYTHING)
    pool, deployment = one(docs, "InferencePool"), one(docs, "Deployment", "demo-canvas")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (port,) = canvas_container(docs)["ports"]
    assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}]
    picker = pool["spec"]["endpointPickerRef"]
    service = one(docs, "Service", picker["name"])
    assert picker["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    epp = one(docs, "Deployment", picker["name"])
    assert (
        service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    )
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    used = {args[args.index(flag) + 1] for flag in args if flag.endswith("-metric")} - {""}
    assert used == {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
    assert used <= exported_metrics()
    config = yaml.safe_load(one(docs, "ConfigMap", picker["name"])["data"]["canvas-plugins.yaml"])
    jsonschema.validate(config, ENDPOINT_PICKER_CONFIG)
    defined = {p.get("name", p["type"]) for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= defined
    (profile,) = config["schedulingProfiles"]
    scorers = {p["pluginRef"] for p in profile["plugins"] if "weight" in p}
    assert scorers == {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"}
    granted = {r for rule in one(docs, "Role")["rules"] for r in rule["resources"]}
    assert {"inferencepools", "pods"} <= granted
    route = one(docs, "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "demo-canvas"}
    ]
    assert route["spec"]["parentRefs"][0]["name"] == one(docs, "Gateway")["metadata"]["name"]


def test_the_alert_rules_and_the_dashboard_ship_as_the_files_in_deploy():
    docs = render({"prometheusRule": {"enabled": True}, "grafanaDashboard": {"enabled": True}})
    rule = one(docs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "canvas-alerts.yaml").read_text())
    assert {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]} >= {
        "CanvasHighErrorRate",
        "CanvasStepLoopUnhealthy",
        "CanvasQueueBuildingUp",
        "CanvasKVCacheNearFull",
        "CanvasHighTimeToFirstToken",
    }
    dashboard = one(docs, "ConfigMap", "demo-canvas-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = dashboard["data"].values()
    assert json.loads(text) == json.loads((CHART / "files" / "canvas-dashboard.json").read_text())
    assert {d["kind"] for d in render()}.isdisjoint({"PrometheusRule", "ConfigMap"})

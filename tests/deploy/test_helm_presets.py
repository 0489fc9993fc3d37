"""The Helm chart's GPU presets (deploy/helm/canvas/values-h100.yaml, values-h200.yaml): each
renders, passes `canvas serve` flags that its parser takes, and promises no more running
requests than the memory plan holds on its GPU at DiffusionGemma 26B-A4B's shapes. The
two-GPU preset (values-tp2-h100.yaml) asks for a GPU per rank and passes the ranks to serve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.cli import build_parser, main

helm = pytest.importorskip(
    "helm_python", reason="the chart tests need Helm's SDK: pip install -e '.[dev]'"
)

CHART = Path(__file__).parents[2] / "deploy" / "helm" / "canvas"
PRESETS = {"h100": CHART / "values-h100.yaml", "h200": CHART / "values-h200.yaml"}
SERVE_PLAN_FLAGS = ("--dtype", "--gpu-memory-utilization", "--max-model-len", "--max-num-seqs")


def rendered_container(values: dict[str, Any]) -> dict[str, Any]:
    """The Canvas container, as the chart renders it."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="demo", namespace="llm")
    texts = [text for name, text in files.items() if name.endswith(".yaml")]
    docs = [doc for text in texts for doc in yaml.safe_load_all(text) if doc]
    (deployment,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def serve_args(values: dict[str, Any]) -> list[str]:
    """The container's `canvas serve` arguments, as the chart renders them."""
    return rendered_container(values)["args"]


@pytest.mark.parametrize("gpu", sorted(PRESETS))
def test_a_gpu_preset_holds_the_requests_it_promises(gpu, capsys):
    values = yaml.safe_load(PRESETS[gpu].read_text())
    args = serve_args({**values, "apiKey": {"value": "k"}})
    assert args[args.index("--device") + 1] == "cuda"
    parser, _ = build_parser()
    serve = parser.parse_args(["serve", *args])  # every flag is one `canvas serve` takes
    flags = [a for flag in SERVE_PLAN_FLAGS for a in (flag, args[args.index(flag) + 1])]
    assert main(["plan", "--preset", "real-26b-a4b", "--gpu", gpu, *flags, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["max_running_requests"] == serve.max_num_seqs, plan
    assert plan["max_model_len"] == serve.max_model_len
    assert plan["canvases_per_step"] >= min(16, serve.max_num_seqs)


def test_the_two_gpu_preset_asks_for_a_gpu_per_rank_and_passes_the_ranks_to_serve():
    values = yaml.safe_load((CHART / "values-tp2-h100.yaml").read_text())
    container = rendered_container({**values, "apiKey": {"value": "k"}})
    parser, _ = build_parser()
    serve = parser.parse_args(["serve", *container["args"]])
    assert serve.tensor_parallel_size == 2 and serve.device == "cuda"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]

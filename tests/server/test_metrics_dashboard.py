"""Every series the Grafana dashboard and the Prometheus alert rules in deploy/ query is one a
Canvas server exports on /metrics (the app over the fake engine, after it has answered a
completion and a 404, so the labelled HTTP series exist)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.server.conftest import make_fake_server

FILES = Path(__file__).parents[2] / "deploy" / "helm" / "canvas" / "files"
DASHBOARD = FILES / "canvas-dashboard.json"
ALERTS = FILES / "canvas-alerts.yaml"

# PromQL words that look like a series name: aggregations and their clauses, set and vector
# matching operators, `bool`, `offset`. A function is any word followed by "(".
KEYWORDS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio", "by", "without", "on", "ignoring",
    "group_left", "group_right", "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan",
}  # fmt: skip
TOKEN = re.compile(r"[0-9][\w.]*|[a-zA-Z_:][a-zA-Z0-9_:]*")  # a number or duration, or a name


def series_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (Grafana's `$variables` allowed) selects."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # range and subquery windows
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)  # Grafana variables
    # label lists: by (...), without (...), on (...), ignoring (...), group_left (...)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in TOKEN.finditer(expr):
        word, rest = match.group(), expr[match.end() :].lstrip()
        if not (word[0].isdigit() or word.lower() in KEYWORDS or rest.startswith("(")):
            names.add(word)
    return names


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            inner = re.fullmatch(r"label_values\((.+?)(?:,\s*\w+)?\)", text)
            yield f"variable {variable['name']}", inner.group(1) if inner else text


def alert_queries(rules: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for group in rules["groups"]:
        for rule in group["rules"]:
            yield f"alert {rule.get('alert') or rule['record']}", rule["expr"]


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """The series names a server's /metrics holds (samples, so `_bucket`, `_total`, ...)."""
    server = make_fake_server()
    with server.client:
        r = server.post("/chat/completions", messages=[{"role": "user", "content": "hi"}])
        assert r.status_code == 200, r.text
        assert server.client.get("/no/such/route").status_code == 404
        text = server.client.get("/metrics").text
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}


def missing(queries: Iterator[tuple[str, str]], exported: set[str]) -> list[str]:
    found = []
    for where, expr in queries:
        names = series_names(expr)
        assert names, f"{where}: no series found in {expr!r}"
        found += [f"{where}: {name}" for name in sorted(names - exported)]
    return found


def test_every_dashboard_panel_queries_a_series_the_server_exports(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    assert missing(dashboard_queries(dashboard), exported) == []


def test_every_alert_rule_queries_a_series_the_server_exports(exported):
    assert missing(alert_queries(yaml.safe_load(ALERTS.read_text())), exported) == []


def test_a_panel_querying_a_series_the_server_does_not_export_is_caught(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    dashboard["panels"][0]["targets"][0]["expr"] = (
        'sum by (model_name) (rate(vllm:spec_decode_num_drafts_total{model_name=~"$model_name"}'
        "[$__rate_interval])) / sum(vllm:num_requests_running)"
    )
    assert missing(dashboard_queries(dashboard), exported) == [
        "panel 'Throughput' A: vllm:spec_decode_num_drafts_total"
    ]


def test_the_dashboard_has_the_panels_an_on_call_needs():
    dashboard = json.loads(DASHBOARD.read_text())
    queried = set().union(*(series_names(e) for _, e in dashboard_queries(dashboard)))
    assert {
        "vllm:generation_tokens_total",  # throughput
        "vllm:time_to_first_token_seconds_bucket",
        "canvas:canvas_latency_seconds_bucket",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "canvas:prefix_cache_usage_perc",
        "canvas:tokens_per_forward_sum",
        "canvas:steps_per_canvas_sum",
        "canvas:http_requests_total",  # 5xx rate
        "vllm:request_success_total",  # aborted requests
    } <= queried


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'histogram_quantile(0.95, sum by (le, route) (rate(a:b_bucket{x="y"}[5m])))',
            {"a:b_bucket"},
        ),
        ("increase(c_total[5m]) == 0 and (d + e) > 0", {"c_total", "d", "e"}),
        ('sum(rate(f{status=~"5.."}[1m] offset 1h)) / on (pod) group_left g', {"f", "g"}),
        ("min_over_time(h[10m:1m]) > 1e3", {"h"}),
    ],
)
def test_the_promql_reader_finds_the_series_and_nothing_else(expr, names):
    assert series_names(expr) == names

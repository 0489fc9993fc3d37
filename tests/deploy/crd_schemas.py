"""JSON Schemas for the custom resources the chart renders, which the Kubernetes schemas
(`kubernetes-validate`) do not cover: ServiceMonitor and PrometheusRule (Prometheus Operator),
InferencePool
(Gateway API Inference Extension v1), HTTPRoute and Gateway (Gateway API v1), and the endpoint
picker's EndpointPickerConfig. Written by hand from the fields, required fields, enums and
bounds of those APIs, for the fields the chart uses: unknown fields are errors, as in a
structural CRD schema."""

from __future__ import annotations

from typing import Any

DNS_LABEL = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
DNS_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253}
DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}


def closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """An object with only these properties."""
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = required
    return schema


METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": DNS_NAME, "namespace": DNS_LABEL, "labels": LABELS},
}


def resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return closed(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )


LABEL_SELECTOR = closed({"matchLabels": LABELS}, ["matchLabels"])

SERVICE_MONITOR = resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    closed(
        {
            "selector": LABEL_SELECTOR,
            "namespaceSelector": {"type": "object"},
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": closed(
                    {
                        "port": {"type": "string", "minLength": 1},
                        "path": {"type": "string", "pattern": "^/"},
                        "interval": DURATION,
                        "scrapeTimeout": DURATION,
                        "scheme": {"enum": ["http", "https"]},
                    }
                ),
            },
        },
        ["selector", "endpoints"],
    ),
)

PROMETHEUS_RULE = resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    closed(
        {
            "groups": {
                "type": "array",
                "items": closed(
                    {
                        "name": {"type": "string", "minLength": 1},
                        "interval": DURATION,
                        "rules": {
                            "type": "array",
                            "items": closed(
                                {
                                    "alert": {"type": "string", "minLength": 1},
                                    "record": {"type": "string", "minLength": 1},
                                    "expr": {"type": "string", "minLength": 1},
                                    "for": DURATION,
                                    "labels": LABELS,
                                    "annotations": LABELS,
                                },
                                ["expr"],
                            ),
                        },
                    },
                    ["name", "rules"],
                ),
            }
        }
    ),
)

INFERENCE_POOL = resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    closed(
        {
            "selector": LABEL_SELECTOR,
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "items": closed({"number": PORT}, ["number"]),
            },
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": closed(
                {
                    "group": {"type": "string"},
                    "kind": {"type": "string", "pattern": "^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
                    "name": DNS_NAME,
                    "port": closed({"number": PORT}, ["number"]),
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
                ["name"],
            ),
        },
        ["selector", "targetPorts"],
    ),
)

PARENT_REF = closed(
    {
        "group": {"type": "string"},
        "kind": {"type": "string"},
        "name": DNS_NAME,
        "namespace": DNS_LABEL,
        "sectionName": DNS_LABEL,
        "port": PORT,
    },
    ["name"],
)
BACKEND_REF = closed(
    {
        "group": {"type": "string"},
        "kind": {"type": "string"},
        "name": DNS_NAME,
        "namespace": DNS_LABEL,
        "port": PORT,
        "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},
    },
    ["name"],
)
HTTP_ROUTE = resource(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    closed(
        {
            "parentRefs": {"type": "array", "maxItems": 32, "items": PARENT_REF},
            "hostnames": {"type": "array", "items": {"type": "string"}},
            "rules": {
                "type": "array",
                "maxItems": 16,
                "items": closed(
                    {
                        "matches": {
                            "type": "array",
                            "maxItems": 64,
                            "items": closed(
                                {
                                    "path": closed(
                                        {
                                            "type": {
                                                "enum": ["Exact", "PathPrefix", "RegularExpression"]
                                            },
                                            "value": {"type": "string", "pattern": "^/"},
                                        }
                                    )
                                }
                            ),
                        },
                        "backendRefs": {"type": "array", "maxItems": 16, "items": BACKEND_REF},
                        "timeouts": closed({"request": DURATION, "backendRequest": DURATION}),
                    }
                ),
            },
        },
    ),
)

GATEWAY = resource(
    "gateway.networking.k8s.io/v1",
    "Gateway",
    closed(
        {
            "gatewayClassName": DNS_NAME,
            "listeners": {
                "type": "array",
                "minItems": 1,
                "maxItems": 64,
                "items": closed(
                    {
                        "name": DNS_LABEL,
                        "protocol": {"type": "string"},
                        "port": PORT,
                        "hostname": {"type": "string"},
                    },
                    ["name", "protocol", "port"],
                ),
            },
        },
        ["gatewayClassName", "listeners"],
    ),
)

CUSTOM_RESOURCES = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE,
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE,
    ("gateway.networking.k8s.io/v1", "Gateway"): GATEWAY,
}

# The endpoint picker's own configuration file (in a ConfigMap).
ENDPOINT_PICKER_CONFIG = closed(
    {
        "apiVersion": {"const": "inference.networking.x-k8s.io/v1alpha1"},
        "kind": {"const": "EndpointPickerConfig"},
        "plugins": {
            "type": "array",
            "minItems": 1,
            "items": closed(
                {"type": {"type": "string"}, "name": {"type": "string"}, "parameters": {}},
                ["type"],
            ),
        },
        "schedulingProfiles": {
            "type": "array",
            "minItems": 1,
            "items": closed(
                {
                    "name": {"type": "string"},
                    "plugins": {
                        "type": "array",
                        "items": closed(
                            {"pluginRef": {"type": "string"}, "weight": {"type": "integer"}},
                            ["pluginRef"],
                        ),
                    },
                },
                ["name", "plugins"],
            ),
        },
    },
    ["apiVersion", "kind", "plugins", "schedulingProfiles"],
)

"""Structural JSON Schemas for the two prometheus-operator custom resources we ship.

kubernetes-validate bundles only built-in kinds (ServiceMonitor and PrometheusRule raise
``SchemaNotFoundError``), and no PyPI package we can load in the light env ships the
operator's CRD schemas (``cloudcoil-models-prometheus-operator`` has pydantic models, but its
pytest plugin breaks collection without ``filelock``). So this is a documented structural
check instead: the subset of ``monitoring.coreos.com/v1`` (prometheus-operator API reference,
ServiceMonitorSpec / Endpoint / RelabelConfig, PrometheusRuleSpec / RuleGroup / Rule) that the
base uses, with the operator's field names and types and ``additionalProperties: false`` at
every level, so a misspelt or misplaced field fails like kubernetes-validate's strict mode
does. The rules themselves are checked by promtool (test_k8s.py).
"""

from __future__ import annotations

from typing import Any

_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253},
        "namespace": {"type": "string"},
        "labels": _LABELS,
        "annotations": _LABELS,
    },
    "additionalProperties": False,
}
_RELABEL = {
    "type": "object",
    "properties": {
        "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
                            "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep",
                            "lowercase", "Lowercase", "uppercase", "Uppercase", "keepequal", "KeepEqual",
                            "dropequal", "DropEqual"]},
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
    },
    "additionalProperties": False,
}
_ENDPOINT = {
    "type": "object",
    "properties": {
        "port": {"type": "string"},
        "targetPort": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "path": {"type": "string"},
        "scheme": {"enum": ["http", "https"]},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
        "honorTimestamps": {"type": "boolean"},
        "relabelings": {"type": "array", "items": _RELABEL},
        "metricRelabelings": {"type": "array", "items": _RELABEL},
    },
    "additionalProperties": False,
}
_SELECTOR = {
    "type": "object",
    "properties": {
        "matchLabels": _LABELS,
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "required": ["key", "operator"],
            "properties": {"key": {"type": "string"}, "operator": {"type": "string"},
                           "values": {"type": "array", "items": {"type": "string"}}},
            "additionalProperties": False}},
    },
    "additionalProperties": False,
}

SERVICE_MONITOR: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": {"type": "object", "properties": {
                    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
                    "additionalProperties": False},
                "jobLabel": {"type": "string"},
                "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}

_RULE = {
    "type": "object",
    "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "integer"}]},
        "for": _DURATION,
        "keep_firing_for": _DURATION,
        "labels": _LABELS,
        "annotations": _LABELS,
    },
    "additionalProperties": False,
}

PROMETHEUS_RULE: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "properties": {
                "groups": {"type": "array", "items": {
                    "type": "object",
                    "required": ["name", "rules"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "interval": _DURATION,
                        "limit": {"type": "integer"},
                        "partial_response_strategy": {"type": "string"},
                        "rules": {"type": "array", "items": _RULE},
                    },
                    "additionalProperties": False,
                }},
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}

SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR, "PrometheusRule": PROMETHEUS_RULE}

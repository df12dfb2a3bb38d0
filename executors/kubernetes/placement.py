"""Where a replica pod may run: the required node affinity that finds GPU nodes by the labels stock clusters have.

A GPU is named on a node by whichever component labelled it, and a cluster may run any mix of them:

* every node: ``node.kubernetes.io/instance-type`` (the well-known label the kubelet and cloud provider set; EKS
  managed node groups, Karpenter and EKS Auto Mode nodes all carry it), e.g. ``g5.12xlarge``;
* Karpenter: ``karpenter.k8s.aws/instance-gpu-name`` (``a10g``) and ``karpenter.k8s.aws/instance-gpu-count``
  (Karpenter's well-known labels); EKS Auto Mode the same names under ``eks.amazonaws.com/``;
* GPU Feature Discovery, only where it is installed: ``nvidia.com/gpu.product`` (``NVIDIA-A10G``) and
  ``nvidia.com/gpu.count`` (NVIDIA/k8s-device-plugin#733: a stock EKS GPU node has no such label).

So ``--gpu A10G`` with K GPUs per pod becomes one ``requiredDuringSchedulingIgnoredDuringExecution`` term per
scheme; the terms are ORed (``NodeSelector``: "the terms are ORed"), the expressions within one ANDed. A node
that matches any scheme and has K allocatable ``nvidia.com/gpu`` takes the pod. Counts use ``Gt K-1``: the
operator takes one integer. A cluster labelled some other way says so with ``backend.gpu_product_label`` (and
``backend.gpu_product_value``): then that one label is the selector.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from diloco.executors.gpus import (
    AUTO_MODE_GPU_COUNT,
    AUTO_MODE_GPU_NAME,
    BY_NAME,
    GFD_COUNT,
    GFD_PRODUCT,
    INSTANCE_TYPE_LABEL,
    KARPENTER_GPU_COUNT,
    KARPENTER_GPU_NAME,
    Gpu,
)
from diloco.executors.kubernetes.config import GPU_RESOURCE


def _expression(key: str, operator: str, values: Sequence[str]) -> dict[str, Any]:
    return {"key": key, "operator": operator, "values": list(values)}


def gpu_node_terms(gpu: Gpu, count: int, *, label: str | None = None,
                   value: str | None = None) -> list[dict[str, Any]]:
    """The ``nodeSelectorTerms`` for ``count`` GPUs of ``gpu`` on one node (see the module docstring)."""
    at_least = str(max(0, count - 1))
    if label:
        values = [value] if value else known_values(gpu, label, count)
        return [{"matchExpressions": [_expression(label, "In", values)]}]
    terms = []
    instance_types = gpu.instance_types(count)
    if instance_types:
        terms.append({"matchExpressions": [_expression(INSTANCE_TYPE_LABEL, "In", instance_types)]})
    for name_label, count_label in ((KARPENTER_GPU_NAME, KARPENTER_GPU_COUNT),
                                    (AUTO_MODE_GPU_NAME, AUTO_MODE_GPU_COUNT)):
        terms.append({"matchExpressions": [_expression(name_label, "In", [gpu.karpenter_name]),
                                           _expression(count_label, "Gt", [at_least])]})
    terms.append({"matchExpressions": [_expression(GFD_PRODUCT, "In", gpu.gfd_products),
                                       _expression(GFD_COUNT, "Gt", [at_least])]})
    return terms


def known_values(gpu: Gpu, label: str, count: int = 1) -> list[str]:
    """What ``label`` says on a node with ``gpu``, for the labels this table knows; else the GPU's names."""
    if label == INSTANCE_TYPE_LABEL:
        return gpu.instance_types(count) or [gpu.name]
    if label in (KARPENTER_GPU_NAME, AUTO_MODE_GPU_NAME):
        return [gpu.karpenter_name]
    if label == GFD_PRODUCT:
        return list(gpu.gfd_products)
    return list(dict.fromkeys([gpu.name, f"NVIDIA-{gpu.name}"]))


def node_affinity(terms: list[dict[str, Any]]) -> dict[str, Any]:
    """The pod's ``affinity`` for ``terms``."""
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}


# ---------------------------------------------------------------------------------------------- matching
def _requirement_met(labels: Mapping[str, str], requirement: Mapping[str, Any]) -> bool:
    """One ``NodeSelectorRequirement`` against a node's labels (``k8s.io/component-helpers`` nodeaffinity)."""
    key, operator, values = requirement["key"], requirement["operator"], requirement.get("values") or []
    present = key in labels
    if operator == "In":
        return present and labels[key] in values
    if operator == "NotIn":
        return not present or labels[key] not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and values:
        try:
            have, bound = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


def node_matches(node: Mapping[str, Any], node_selector: Mapping[str, str],
                 terms: list[dict[str, Any]] | None) -> bool:
    """Whether a node's labels satisfy the pod's ``nodeSelector`` and any one of its required affinity terms."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    if any(labels.get(k) != v for k, v in node_selector.items()):
        return False
    if not terms:
        return True
    return any(all(_requirement_met(labels, r) for r in term.get("matchExpressions") or []) for term in terms)


def _tolerates(tolerations: list[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    """Whether one toleration matches the taint (``k8s.io/api/core/v1`` ``Toleration.ToleratesTaint``)."""
    for t in tolerations:
        if t.get("effect") not in (None, "", taint.get("effect")):
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _allocatable(node: Mapping[str, Any], resource: str) -> int:
    value = str(((node.get("status") or {}).get("allocatable") or {}).get(resource, "0"))
    return int(value) if value.isdigit() else 0


def _ready(node: Mapping[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def node_fits(node: Mapping[str, Any], node_selector: Mapping[str, str], terms: list[dict[str, Any]] | None,
              tolerations: list[Mapping[str, Any]], gpus: int) -> bool:
    """Whether the scheduler could place the replica pod on this node as it is: Ready and not cordoned, its
    labels matched, every ``NoSchedule``/``NoExecute`` taint tolerated, ``gpus`` allocatable ``nvidia.com/gpu``
    (what other pods already use is not counted: this is about the node's kind, not this moment's load)."""
    if (node.get("spec") or {}).get("unschedulable") or not _ready(node):
        return False
    if not node_matches(node, node_selector, terms):
        return False
    taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("effect") in ("NoSchedule",
                                                                                               "NoExecute")]
    if not all(_tolerates(tolerations, t) for t in taints):
        return False
    return gpus <= 0 or _allocatable(node, GPU_RESOURCE) >= gpus


def describe_selector(node_selector: Mapping[str, str], terms: list[dict[str, Any]] | None) -> str:
    """The selector in one line, for messages: ``a=b, and one of: (x in [..]) or (y in [..], z > 3)``."""
    parts = [f"{k}={v}" for k, v in node_selector.items()]
    if terms:
        alternatives = []
        for term in terms:
            expressions = []
            for r in term.get("matchExpressions") or []:
                values = r.get("values") or []
                symbol = {"In": "in", "NotIn": "not in", "Gt": ">", "Lt": "<"}.get(r["operator"], r["operator"])
                shown = values[0] if r["operator"] in ("Gt", "Lt") else "[" + ",".join(values) + "]"
                expressions.append(f"{r['key']} {symbol} {shown}")
            alternatives.append("(" + ", ".join(expressions) + ")")
        parts.append(" or ".join(alternatives))
    return " and ".join(parts) if parts else "any node"


def gpu_terms_for(config: Any, product: str, gpus: int) -> list[dict[str, Any]]:
    """The node terms of a replica with ``gpus`` GPUs of ``product`` under the backend's settings."""
    return gpu_node_terms(BY_NAME[product], gpus, label=config.gpu_product_label, value=config.gpu_product_value)


def gpu_affinity(config: Any, product: str, gpus: int) -> dict[str, Any]:
    """The pod's ``affinity`` for ``gpus`` GPUs of ``product`` (a canonical name) under the backend's settings."""
    return node_affinity(gpu_terms_for(config, product, gpus))

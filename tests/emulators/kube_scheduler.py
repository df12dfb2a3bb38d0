"""The default scheduler's filters and its ``FailedScheduling`` wording, as pure functions over API objects.

A pod fits a node when every filter of the default profile passes, in the profile's order, the first failure
deciding that node's reason (``pkg/scheduler/framework/runtime`` ``RunFilterPlugins`` stops at the first
non-success; order from ``pkg/scheduler/apis/config/v1/default_plugins.go``):

1. ``NodeUnschedulable``: a cordoned node (``spec.unschedulable``) unless the pod tolerates
   ``node.kubernetes.io/unschedulable:NoSchedule`` -> "node(s) were unschedulable" (unresolvable).
2. ``TaintToleration``: the first ``NoSchedule``/``NoExecute`` taint no toleration tolerates ->
   "node(s) had untolerated taint {key: value}" (unresolvable; ``v1.Toleration.ToleratesTaint``: effect empty or
   equal, key empty or equal, ``Exists`` or an equal value).
3. ``NodeAffinity``: ``nodeSelector`` (every pair) and required ``nodeAffinity`` (``nodeSelectorTerms`` ORed, a
   term's ``matchExpressions``/``matchFields`` ANDed, an empty term matching nothing; ``In``, ``NotIn``,
   ``Exists``, ``DoesNotExist``, ``Gt``, ``Lt`` as ``k8s.io/component-helpers/scheduling/corev1/nodeaffinity``)
   -> "node(s) didn't match Pod's node affinity/selector" (unresolvable).
4. ``NodeResourcesFit`` (``noderesources/fit.go`` ``fitsRequest``): "Too many pods" when the node's ``pods`` is
   used up, then "Insufficient <resource>" for every requested resource (cpu, memory, ephemeral-storage, extended
   resources such as ``nvidia.com/gpu``) that allocatable minus the requests of the node's non-terminal pods does
   not cover; unresolvable when the request is above the node's whole allocatable. The pod's request is
   ``resourcehelper.PodRequests``: the larger of the containers' sum and the init containers' peak (restartable
   init containers, i.e. sidecars, count towards both), plus ``overhead``.

The message is ``FitError.Error()`` (``pkg/scheduler/framework/types.go``): "0/N nodes are available: " and the
sorted histogram "<count> <reason>" joined with ", " and a final "."; then DefaultPreemption's PostFilter adds
" preemption: 0/N nodes are available: ..." where unresolvable nodes read "Preemption is not helpful for
scheduling" and the others "No preemption victims found for incoming pod" (every emulated pod has the same
priority, so there is never a lower-priority victim; ``pkg/scheduler/framework/preemption``). With no nodes at
all the scheduler says "no nodes available to schedule pods" (``ErrNoNodesAvailable``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from .kube_store import Obj
from .kube_validation import parse_quantity

NO_NODES = "no nodes available to schedule pods"
AFFINITY_REASON = "node(s) didn't match Pod's node affinity/selector"
UNSCHEDULABLE_REASON = "node(s) were unschedulable"
NOT_HELPFUL = "Preemption is not helpful for scheduling"
NO_VICTIMS = "No preemption victims found for incoming pod"
#: Resources ``fitsRequest`` checks by name before the scalar (extended) ones.
NATIVE = ("cpu", "memory", "ephemeral-storage")


@dataclass
class Verdict:
    """Why one node does not fit: the filter's reasons and whether preemption could ever help."""

    reasons: list[str] = field(default_factory=list)
    unresolvable: bool = True


def quantity(raw: Any) -> Decimal:
    return parse_quantity(raw)[0]


def _add(total: dict[str, Decimal], more: dict[str, Decimal]) -> dict[str, Decimal]:
    out = dict(total)
    for key, value in more.items():
        out[key] = out.get(key, Decimal(0)) + value
    return out


def _container_requests(container: Obj) -> dict[str, Decimal]:
    requests = (container.get("resources") or {}).get("requests") or {}
    return {name: quantity(value) for name, value in requests.items()}


def pod_requests(pod_spec: Obj) -> dict[str, Decimal]:
    """``resourcehelper.PodRequests``: max(containers' sum + sidecars, init peak) per resource, plus overhead."""
    total: dict[str, Decimal] = {}
    for container in pod_spec.get("containers", []):
        total = _add(total, _container_requests(container))
    sidecars: dict[str, Decimal] = {}
    init_peak: dict[str, Decimal] = {}
    for container in pod_spec.get("initContainers", []):
        requests = _container_requests(container)
        if container.get("restartPolicy") == "Always":
            sidecars = _add(sidecars, requests)
            candidate = sidecars
        else:
            candidate = _add(sidecars, requests)
        for key, value in candidate.items():
            init_peak[key] = max(init_peak.get(key, Decimal(0)), value)
    total = _add(total, sidecars)
    for key, value in init_peak.items():
        total[key] = max(total.get(key, Decimal(0)), value)
    overhead = {name: quantity(value) for name, value in (pod_spec.get("overhead") or {}).items()}
    return _add(total, overhead)


def tolerates(toleration: Obj, taint: Obj) -> bool:
    """``Toleration.ToleratesTaint``."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    if toleration.get("operator") == "Exists":
        return True
    return (toleration.get("value") or "") == (taint.get("value") or "")


def untolerated_taint(taints: list[Obj], tolerations: list[Obj],
                      effects: tuple[str, ...] = ("NoSchedule", "NoExecute")) -> Obj | None:
    """The first taint with one of ``effects`` that no toleration tolerates (``FindMatchingUntoleratedTaint``)."""
    for taint in taints:
        if taint.get("effect") in effects and not any(tolerates(t, taint) for t in tolerations):
            return taint
    return None


def _requirement(requirement: Obj, value: str | None) -> bool:
    operator, values = requirement.get("operator"), requirement.get("values") or []
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt"):
        try:
            have, bound = int(value or ""), int(values[0])
        except (ValueError, IndexError):
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


def _term_matches(term: Obj, labels: dict[str, str], name: str) -> bool:
    expressions, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not expressions and not fields:
        return False
    return all(_requirement(r, labels.get(r.get("key", ""))) for r in expressions) and all(
        _requirement(r, name if r.get("key") == "metadata.name" else None) for r in fields)


def matches_node(pod_spec: Obj, node_obj: Obj) -> bool:
    """``nodeSelector`` and required ``nodeAffinity`` against the node's labels (and name, for ``matchFields``)."""
    labels = node_obj["metadata"].get("labels") or {}
    name = node_obj["metadata"]["name"]
    if any(labels.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    required = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True
    return any(_term_matches(term, labels, name) for term in required.get("nodeSelectorTerms") or [])


def _resources_verdict(requests: dict[str, Decimal], node_obj: Obj, used: dict[str, Decimal],
                       pod_count: int) -> Verdict | None:
    allocatable = {k: quantity(v) for k, v in (node_obj["status"].get("allocatable") or {}).items()}
    verdict = Verdict(unresolvable=False)
    if pod_count + 1 > allocatable.get("pods", Decimal(0)):
        verdict.reasons.append("Too many pods")
    ordered = [k for k in NATIVE if k in requests] + sorted(k for k in requests if k not in NATIVE and k != "pods")
    for resource in ordered:
        wanted = requests[resource]
        if wanted <= 0:
            continue
        have = allocatable.get(resource, Decimal(0))
        if wanted > have - used.get(resource, Decimal(0)):
            verdict.reasons.append(f"Insufficient {resource}")
            verdict.unresolvable |= wanted > have
    return verdict if verdict.reasons else None


def filter_node(pod_spec: Obj, node_obj: Obj, used: dict[str, Decimal], pod_count: int) -> Verdict | None:
    """``None`` when the pod fits the node, else the first failing filter's verdict."""
    tolerations = pod_spec.get("tolerations") or []
    spec = node_obj.get("spec") or {}
    cordon = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
    if spec.get("unschedulable") and not any(tolerates(t, cordon) for t in tolerations):
        return Verdict([UNSCHEDULABLE_REASON])
    taint = untolerated_taint(spec.get("taints") or [], tolerations)
    if taint is not None:
        return Verdict([f"node(s) had untolerated taint {{{taint.get('key', '')}: {taint.get('value', '')}}}"])
    if not matches_node(pod_spec, node_obj):
        return Verdict([AFFINITY_REASON])
    return _resources_verdict(pod_requests(pod_spec), node_obj, used, pod_count)


def _histogram(reasons: list[str]) -> str:
    counts = Counter(reasons)
    return ", ".join(sorted(f"{n} {reason}" for reason, n in counts.items()))


def failed_scheduling_message(verdicts: list[Verdict], pod_spec: Obj) -> str:
    """``FitError.Error()`` plus DefaultPreemption's PostFilter message, for a pod no node fits."""
    if not verdicts:
        return NO_NODES
    total = len(verdicts)
    message = f"0/{total} nodes are available: {_histogram([r for v in verdicts for r in v.reasons])}."
    if pod_spec.get("preemptionPolicy") == "Never":
        return f"{message} preemption: not eligible due to preemptionPolicy=Never."
    preemption = _histogram([NOT_HELPFUL if v.unresolvable else NO_VICTIMS for v in verdicts])
    return f"{message} preemption: 0/{total} nodes are available: {preemption}."


def least_allocated_score(requests: dict[str, Decimal], node_obj: Obj, used: dict[str, Decimal]) -> Decimal:
    """``NodeResourcesFit`` ``LeastAllocated`` over cpu and memory: the share left free after this pod, 0-100."""
    allocatable = node_obj["status"].get("allocatable") or {}
    scores = []
    for resource in ("cpu", "memory"):
        have = quantity(allocatable.get(resource, "0"))
        if have <= 0:
            scores.append(Decimal(0))
            continue
        after = used.get(resource, Decimal(0)) + requests.get(resource, Decimal(0))
        scores.append(max(Decimal(0), (have - after) * 100 / have))
    return sum(scores, Decimal(0)) / len(scores)


__all__ = ["NO_NODES", "Verdict", "failed_scheduling_message", "filter_node", "least_allocated_score",
           "matches_node", "pod_requests", "tolerates", "untolerated_taint"]

"""Server-side printing: the ``meta.k8s.io/v1`` ``Table`` that ``kubectl get`` asks for.

``kubectl get`` sends ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io,...,application/json`` and prints
whatever columns the server returns, so the columns and cells are the API server's own printers
(``pkg/printers/internalversion/printers.go``, 1.33): pods NAME/READY/STATUS/RESTARTS/AGE (``printPod``), jobs
NAME/STATUS/COMPLETIONS/DURATION/AGE (``printJob``), namespaces, service accounts, events and nodes likewise, and
the generic NAME/CREATED AT of ``DefaultTableConvertor`` for anything else. Columns of priority 1 are what
``-o wide`` adds. Each row carries the object as ``PartialObjectMetadata`` (``includeObject=Metadata``, the
default), or whole with ``includeObject=Object``, or nothing with ``None``. Durations are
``k8s.io/apimachinery/pkg/util/duration.HumanDuration``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

Obj = dict[str, Any]
Column = tuple[str, str, int, str]  # name, type, priority, description

_NAME = ("Name", "string", 0, "Name must be unique within a namespace.")
_AGE = ("Age", "string", 0, "CreationTimestamp is a timestamp representing the server time when this object was "
                            "created.")
POD_COLUMNS: list[Column] = [
    _NAME, ("Ready", "string", 0, "The aggregate readiness state of this pod for accepting traffic."),
    ("Status", "string", 0, "The aggregate status of the containers in this pod."),
    ("Restarts", "string", 0, "The number of times the containers in this pod have been restarted and when the "
                              "last container in this pod has restarted."),
    _AGE, ("IP", "string", 1, "podIP address allocated to the pod."),
    ("Node", "string", 1, "NodeName indicates in which node this pod is scheduled."),
    ("Nominated Node", "string", 1, "nominatedNodeName is set only when this pod preempts other pods on the node."),
    ("Readiness Gates", "string", 1, "If specified, all readiness gates will be evaluated for pod readiness.")]
JOB_COLUMNS: list[Column] = [
    _NAME, ("Status", "string", 0, "Status of the job."),
    ("Completions", "string", 0, "The number of pods which reached phase Succeeded."),
    ("Duration", "string", 0, "Time required to complete the job."), _AGE,
    ("Containers", "string", 1, "Names of each container in the template."),
    ("Images", "string", 1, "Images referenced by each container in the template."),
    ("Selector", "string", 1, "A label query over pods that should match the pod count.")]
NAMESPACE_COLUMNS: list[Column] = [_NAME, ("Status", "string", 0, "The status of the namespace"), _AGE]
SERVICE_ACCOUNT_COLUMNS: list[Column] = [_NAME, ("Secrets", "string", 0, "Secrets is a list of the secrets."), _AGE]
EVENT_COLUMNS: list[Column] = [
    ("Last Seen", "string", 0, "The time at which the most recent occurrence of this event was recorded."),
    ("Type", "string", 0, "Type of this event (Normal, Warning), new types could be added in the future"),
    ("Reason", "string", 0, "This should be a short, machine understandable string that gives the reason for the "
                            "transition into the object's current status."),
    ("Object", "string", 0, "The object that this event is about."),
    ("Subobject", "string", 1, "If referring to a piece of an object instead of an entire object."),
    ("Source", "string", 1, "The component reporting this event."),
    ("Message", "string", 0, "A human-readable description of the status of this operation."),
    ("First Seen", "string", 1, "The time at which the event was first recorded."),
    ("Count", "string", 1, "The number of times this event has occurred."),
    ("Name", "string", 1, "Name must be unique within a namespace.")]
NODE_COLUMNS: list[Column] = [
    _NAME, ("Status", "string", 0, "The status of the node"), ("Roles", "string", 0, "The roles of the node"),
    _AGE, ("Version", "string", 0, "Kubelet Version reported by the node.")]
DEFAULT_COLUMNS: list[Column] = [_NAME, ("Created At", "date", 0, _AGE[3])]


def _parse(stamp: str | None) -> dt.datetime | None:
    if not stamp:
        return None
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def human_duration(seconds: float) -> str:
    """``duration.HumanDuration``: 59s, 2m10s, 3h, 5d ... as ``kubectl get`` prints ages."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        years, days = hours // 24 // 365, (hours // 24) % 365
        return f"{years}y" if days == 0 else f"{years}y{days}d"
    return f"{hours // 24 // 365}y"


def since(stamp: str | None, now: dt.datetime) -> str:
    """``translateTimestampSince``: ``<unknown>`` for a zero time."""
    when = _parse(stamp)
    return "<unknown>" if when is None else human_duration((now - when).total_seconds())


def _condition(obj: Obj, kind: str) -> bool:
    """``hasJobCondition``: the first condition of that type, and whether it is true."""
    for cond in obj.get("status", {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond.get("status") == "True"
    return False


def pod_cells(pod: Obj, now: dt.datetime) -> list[Any]:
    """``printPod`` for a pod without restartable init containers (what the emulator runs)."""
    status, spec = pod.get("status") or {}, pod.get("spec") or {}
    reason = status.get("reason") or status.get("phase") or ""
    restarts, last_restart = 0, None
    initializing = False
    for i, cs in enumerate(status.get("initContainerStatuses") or []):
        restarts += cs.get("restartCount", 0)
        last = (cs.get("lastState") or {}).get("terminated")
        if last and (last_restart is None or (last.get("finishedAt") or "") > last_restart):
            last_restart = last.get("finishedAt")
        state = cs.get("state") or {}
        terminated, waiting = state.get("terminated"), state.get("waiting")
        if terminated and terminated.get("exitCode") == 0:
            continue
        if terminated:
            reason = "Init:" + terminated["reason"] if terminated.get("reason") else \
                f"Init:ExitCode:{terminated.get('exitCode')}"
        elif waiting and waiting.get("reason") and waiting["reason"] != "PodInitializing":
            reason = "Init:" + waiting["reason"]
        else:
            reason = f"Init:{i}/{len(spec.get('initContainers') or [])}"
        initializing = True
        break
    ready = 0
    initialized = any(c.get("type") == "Initialized" and c.get("status") == "True"
                      for c in status.get("conditions") or [])
    if not initializing or initialized:
        restarts, last_restart, running = 0, None, False
        for cs in reversed(status.get("containerStatuses") or []):
            restarts += cs.get("restartCount", 0)
            last = (cs.get("lastState") or {}).get("terminated")
            if last and (last_restart is None or (last.get("finishedAt") or "") > last_restart):
                last_restart = last.get("finishedAt")
            state = cs.get("state") or {}
            if (state.get("waiting") or {}).get("reason"):
                reason = state["waiting"]["reason"]
            elif state.get("terminated") is not None:
                terminated = state["terminated"]
                reason = terminated.get("reason") or f"ExitCode:{terminated.get('exitCode')}"
            elif cs.get("ready") and state.get("running") is not None:
                running = True
                ready += 1
        if reason == "Completed" and running:
            pod_ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                            for c in status.get("conditions") or [])
            reason = "Running" if pod_ready else "NotReady"
    deleting = (pod.get("metadata") or {}).get("deletionTimestamp")
    if deleting and status.get("reason") == "NodeLost":
        reason = "Unknown"
    elif deleting and status.get("phase") not in ("Succeeded", "Failed"):
        reason = "Terminating"
    shown = str(restarts)
    if restarts and last_restart:
        shown = f"{restarts} ({since(last_restart, now)} ago)"
    ips = status.get("podIPs") or []
    return [pod["metadata"]["name"], f"{ready}/{len(spec.get('containers') or [])}", reason, shown,
            since(pod["metadata"].get("creationTimestamp"), now), (ips[0].get("ip") if ips else "") or "<none>",
            spec.get("nodeName") or "<none>", status.get("nominatedNodeName") or "<none>", "<none>"]


def _selector(selector: Obj | None) -> str:
    """``metav1.FormatLabelSelector`` for the matchLabels-only selectors Jobs carry."""
    if not selector:
        return "<none>"
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        parts.append(f"{expr['key']} {expr['operator'].lower()} ({','.join(expr.get('values') or [])})")
    return ",".join(parts) or "<none>"


def job_cells(job: Obj, now: dt.datetime) -> list[Any]:
    """``printJob``: its verdict, succeeded/completions, how long it ran and its age."""
    spec, status = job.get("spec") or {}, job.get("status") or {}
    succeeded = status.get("succeeded", 0)
    if spec.get("completions") is not None:
        completions = f"{succeeded}/{spec['completions']}"
    elif (spec.get("parallelism") or 0) > 1:
        completions = f"{succeeded}/1 of {spec['parallelism']}"
    else:
        completions = f"{succeeded}/1"
    started, finished = _parse(status.get("startTime")), _parse(status.get("completionTime"))
    took = "" if started is None else human_duration(((finished or now) - started).total_seconds())
    if _condition(job, "Complete"):
        verdict = "Complete"
    elif _condition(job, "Failed"):
        verdict = "Failed"
    elif (job.get("metadata") or {}).get("deletionTimestamp"):
        verdict = "Terminating"
    elif _condition(job, "Suspended"):
        verdict = "Suspended"
    elif _condition(job, "FailureTarget"):
        verdict = "FailureTarget"
    elif _condition(job, "SuccessCriteriaMet"):
        verdict = "SuccessCriteriaMet"
    else:
        verdict = "Running"
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
    return [job["metadata"]["name"], verdict, completions, took, since(job["metadata"].get("creationTimestamp"), now),
            ",".join(c.get("name", "") for c in containers), ",".join(c.get("image", "") for c in containers),
            _selector(spec.get("selector"))]


def event_cells(event: Obj, now: dt.datetime) -> list[Any]:
    """``printEvent``: when, what kind, why, about which object, and the message."""
    involved = event.get("involvedObject") or {}
    source = event.get("source") or {}
    origin = ", ".join(v for v in (source.get("component"), source.get("host")) if v) or \
        event.get("reportingComponent") or ""
    last = event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp")
    first = event.get("firstTimestamp") or event.get("eventTime") or last
    count = event.get("count") or 1
    shown = since(last, now) if count <= 1 else f"{since(last, now)} (x{count} over {since(first, now)})"
    return [shown, event.get("type", ""), event.get("reason", ""),
            f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}", involved.get("fieldPath", ""),
            origin, (event.get("message") or "").strip(), since(first, now), str(count), event["metadata"]["name"]]


def node_cells(node: Obj, now: dt.datetime) -> list[Any]:
    """``printNode``: Ready/NotReady (plus SchedulingDisabled), roles from the node-role labels, kubelet version."""
    ready = next((c.get("status") for c in (node.get("status") or {}).get("conditions") or []
                  if c.get("type") == "Ready"), None)
    shown = {"True": "Ready", None: "Unknown"}.get(ready, "NotReady")
    if (node.get("spec") or {}).get("unschedulable"):
        shown += ",SchedulingDisabled"
    labels = node["metadata"].get("labels") or {}
    roles = sorted({k.split("/", 1)[1] for k in labels if k.startswith("node-role.kubernetes.io/")} |
                   ({labels["kubernetes.io/role"]} if labels.get("kubernetes.io/role") else set()))
    version = ((node.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion", "")
    return [node["metadata"]["name"], shown, ",".join(roles) or "<none>",
            since(node["metadata"].get("creationTimestamp"), now), version]


PRINTERS: dict[str, tuple[list[Column], Callable[[Obj, dt.datetime], list[Any]]]] = {
    "pods": (POD_COLUMNS, pod_cells),
    "jobs": (JOB_COLUMNS, job_cells),
    "namespaces": (NAMESPACE_COLUMNS, lambda o, now: [o["metadata"]["name"], (o.get("status") or {}).get(
        "phase", "Active"), since(o["metadata"].get("creationTimestamp"), now)]),
    "serviceaccounts": (SERVICE_ACCOUNT_COLUMNS, lambda o, now: [o["metadata"]["name"], len(o.get("secrets") or []),
                                                                 since(o["metadata"].get("creationTimestamp"), now)]),
    "events": (EVENT_COLUMNS, event_cells),
    "nodes": (NODE_COLUMNS, node_cells),
}


def wants_table(accept: str | None) -> bool:
    """Whether the client asked for ``as=Table;v=v1;g=meta.k8s.io`` (its first choice wins, as in negotiation)."""
    for clause in (accept or "").split(","):
        params = {k.strip(): v.strip() for k, _, v in (p.partition("=") for p in clause.split(";")[1:])}
        if params.get("as") == "Table" and params.get("g") == "meta.k8s.io" and params.get("v") == "v1":
            return True
        if clause.split(";")[0].strip() in ("application/json", "*/*") and "as" not in params:
            return False
    return False


def table(resource: str, objects: list[Obj], api_version: str, kind: str, resource_version: str,
          include_object: str | None) -> Obj:
    """The ``Table`` for a list (or one object) of ``resource``."""
    columns, cells = PRINTERS.get(resource, (DEFAULT_COLUMNS, lambda o, now: [
        o["metadata"]["name"], o["metadata"].get("creationTimestamp")]))
    now = dt.datetime.now(dt.timezone.utc)
    rows = []
    for obj in objects:
        row: Obj = {"cells": cells(obj, now)}
        if resource == "pods" and (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            phase = obj["status"]["phase"]
            row["conditions"] = [{"type": "Completed", "status": "True", "reason": phase,
                                  "message": "The pod has completed successfully." if phase == "Succeeded"
                                  else "The pod failed."}]
        if include_object in (None, "", "Metadata"):
            row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                             "metadata": obj["metadata"]}
        elif include_object == "Object":
            row["object"] = {"kind": kind, "apiVersion": api_version, **obj}
        rows.append(row)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": [{"name": n, "type": t, "format": "name" if n == "Name" else "",
                                   "description": d, "priority": p} for n, t, p, d in columns],
            "rows": rows}


__all__ = ["PRINTERS", "human_duration", "table", "wants_table"]

"""The emulator's etcd: objects by kind, one resourceVersion counter, the change history that watches replay.

Objects are plain JSON dicts, exactly what the API server would serialize, so the HTTP layer never converts
anything. Every change bumps a cluster-wide ``resourceVersion`` and appends a snapshot to a bounded history; a
watch sends the snapshots newer than the version it was given, and a version older than the history is answered
with the ``410 Expired`` event the client knows how to recover from.
"""

from __future__ import annotations

import copy
import datetime as dt
import re
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .kube_errors import ApiError, bad_request

#: Resource kinds the store holds, keyed by their REST resource name.
KINDS = ("namespaces", "serviceaccounts", "jobs", "pods", "events", "nodes")
#: How many changes a watch can resume from before it must relist (the API server's watch cache is similar).
HISTORY = 50_000

Obj = dict[str, Any]


def now_rfc3339() -> str:
    """A ``metav1.Time``: RFC 3339 in UTC with whole seconds, as the API server serializes it."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_uid() -> str:
    return str(uuid.uuid4())


def random_suffix(length: int = 5) -> str:
    """``utilrand.String``: the alphabet the API server uses for ``generateName`` (no vowels, no look-alikes)."""
    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    return "".join(secrets.choice(alphabet) for _ in range(length))


@dataclass
class Change:
    """One entry of the watch history: the version it produced and the object as it was then."""

    rv: int
    kind: str
    type: str
    obj: Obj


class Store:
    """All objects plus the change history; callers hold ``lock`` while they read or change anything."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.rv = 0
        self.objects: dict[str, dict[tuple[str, str], Obj]] = {kind: {} for kind in KINDS}
        self.history: deque[Change] = deque(maxlen=HISTORY)
        self.closed = False

    # ------------------------------------------------------------------ writes (callers hold the lock)

    def _record(self, kind: str, obj: Obj, change: str) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append(Change(self.rv, kind, change, copy.deepcopy(obj)))
        self.changed.notify_all()

    def add(self, kind: str, obj: Obj) -> Obj:
        """Store a new object, filling in uid and creationTimestamp; the caller checked it does not exist."""
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", new_uid())
        meta.setdefault("creationTimestamp", now_rfc3339())
        self.objects[kind][(meta.get("namespace", ""), meta["name"])] = obj
        self._record(kind, obj, "ADDED")
        return obj

    def touch(self, kind: str, obj: Obj) -> None:
        """Record an in-place change to a stored object."""
        self._record(kind, obj, "MODIFIED")

    def remove(self, kind: str, obj: Obj) -> None:
        """Delete an object for good (its finalizers are gone)."""
        meta = obj["metadata"]
        if self.objects[kind].pop((meta.get("namespace", ""), meta["name"]), None) is not None:
            self._record(kind, obj, "DELETED")

    # ------------------------------------------------------------------ reads (callers hold the lock)

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        return self.objects[kind].get((namespace, name))

    def items(self, kind: str, namespace: str | None = None) -> list[Obj]:
        """Objects of a kind, optionally of one namespace, in name order (the API server lists by key)."""
        keyed = sorted(self.objects[kind].items())
        return [obj for (ns, _), obj in keyed if namespace is None or ns == namespace]

    def by_uid(self, kind: str, uid: str) -> Obj | None:
        return next((o for o in self.objects[kind].values() if o["metadata"].get("uid") == uid), None)

    # ------------------------------------------------------------------ watches

    def changes_after(self, rv: int, kind: str, match: Callable[[Obj], bool], timeout: float) -> list[Change] | None:
        """Changes newer than ``rv`` that match, waiting up to ``timeout``; ``None`` when ``rv`` is too old."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                if self.history and rv < self.history[0].rv - 1 and len(self.history) == self.history.maxlen:
                    return None
                found = self._newer(rv, kind, match)
                remaining = deadline - time.monotonic()
                if found or remaining <= 0 or self.closed:
                    return found
                self.changed.wait(min(remaining, 0.5))

    def _newer(self, rv: int, kind: str, match: Callable[[Obj], bool]) -> list[Change]:
        """The matching changes after ``rv``, oldest first (scanning back from the newest)."""
        found: list[Change] = []
        for change in reversed(self.history):
            if change.rv <= rv:
                break
            if change.kind == kind and match(change.obj):
                found.append(change)
        return found[::-1]

    def watch(self, kind: str, rv: int | None, match: Callable[[Obj], bool],
              current: Callable[[], list[Obj]], until: float) -> Iterator[tuple[str, Obj] | None]:
        """Watch events as ``(type, object)``; ``None`` once for an expired version; ends at ``until``."""
        with self.lock:
            if rv is None or rv == 0:
                start = self.rv
                initial = [copy.deepcopy(o) for o in current()]
            else:
                start, initial = rv, []
        for obj in initial:
            yield "ADDED", obj
        last = start
        while time.monotonic() < until and not self.closed:
            changes = self.changes_after(last, kind, match, min(1.0, max(0.0, until - time.monotonic())))
            if changes is None:
                yield None
                return
            for change in changes:
                last = change.rv
                yield change.type, change.obj


# ---------------------------------------------------------------------------------------------------- selectors

_SET_REQ = re.compile(r"^\s*([^\s!=(),]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQ_REQ = re.compile(r"^\s*([^\s!=(),]+)\s*(==|=|!=)\s*([^\s!=(),]*)\s*$")
_EXISTS_REQ = re.compile(r"^\s*(!?)\s*([^\s!=(),]+)\s*$")


def _split_requirements(text: str) -> list[str]:
    """Split a selector on the commas that are not inside ``in (a,b)`` lists."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in parts if p.strip()]


def label_selector(text: str | None) -> Callable[[dict[str, str]], bool]:
    """A predicate over a label map for a ``labelSelector`` string (equality- and set-based requirements)."""
    checks: list[Callable[[dict[str, str]], bool]] = []
    for requirement in _split_requirements(text or ""):
        checks.append(_label_requirement(requirement))
    return lambda labels: all(check(labels or {}) for check in checks)


def _label_requirement(requirement: str) -> Callable[[dict[str, str]], bool]:
    set_match, eq_match, exists_match = (_SET_REQ.match(requirement), _EQ_REQ.match(requirement),
                                         _EXISTS_REQ.match(requirement))
    if set_match:
        key, op, values = set_match.group(1), set_match.group(2), {v.strip() for v in set_match.group(3).split(",")}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if eq_match:
        key, op, value = eq_match.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if exists_match:
        negate, key = exists_match.group(1) == "!", exists_match.group(2)
        return lambda labels: (key in labels) != negate
    raise bad_request(f"unable to parse requirement: found '{requirement.strip()}', expected: in, notin, =, ==, "
                      "!=, gt, lt")


#: Field selectors each kind supports (``fields.Set`` of its registry strategy), all else is a 400.
FIELD_SELECTORS: dict[str, tuple[str, ...]] = {
    "pods": ("metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
             "spec.serviceAccountName", "status.phase", "status.podIP", "status.nominatedNodeName"),
    "events": ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
               "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
               "reportingComponent", "source", "type", "metadata.name", "metadata.namespace"),
    "jobs": ("metadata.name", "metadata.namespace", "status.successful"),
    "namespaces": ("metadata.name", "status.phase"),
    "serviceaccounts": ("metadata.name", "metadata.namespace"),
    "nodes": ("metadata.name", "spec.unschedulable"),
}


def _dig(obj: Obj, dotted: str) -> str:
    value: Any = obj
    if dotted == "source":
        return str((obj.get("source") or {}).get("component", ""))
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def field_selector(kind: str, text: str | None) -> Callable[[Obj], bool]:
    """A predicate over objects for a ``fieldSelector`` string (``=``, ``==`` and ``!=`` only, as upstream)."""
    checks: list[Callable[[Obj], bool]] = []
    for requirement in _split_requirements(text or ""):
        match = re.match(r"^\s*([^!=\s]+)\s*(==|=|!=)\s*(.*?)\s*$", requirement)
        if not match:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{requirement}'")
        name, op, value = match.groups()
        if name not in FIELD_SELECTORS.get(kind, ()):
            raise bad_request(f'field label not supported: {name}')
        checks.append((lambda n, v: lambda o: _dig(o, n) == v)(name, value) if op != "!=" else
                      (lambda n, v: lambda o: _dig(o, n) != v)(name, value))
    return lambda obj: all(check(obj) for check in checks)


def matches(obj: Obj, namespace: str | None, labels: Callable[[dict[str, str]], bool],
            fields: Callable[[Obj], bool]) -> bool:
    """Whether an object belongs in a list or watch of ``namespace`` filtered by both selectors."""
    meta = obj.get("metadata", {})
    return (namespace is None or meta.get("namespace") == namespace) and labels(meta.get("labels") or {}) \
        and fields(obj)


__all__ = ["ApiError", "Change", "Store", "field_selector", "label_selector", "matches", "now_rfc3339",
           "random_suffix", "new_uid"]

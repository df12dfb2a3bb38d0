"""API discovery: what ``kubectl`` reads before anything else to map ``jobs`` or ``po`` to a URL.

client-go's discovery client asks ``/api`` and ``/apis`` for the aggregated form first
(``Accept: application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,...,application/json``) and,
when the answer's ``Content-Type`` is plain ``application/json``, falls back to legacy discovery: the
``APIVersions`` / ``APIGroupList`` documents, then one ``APIResourceList`` per group version (client-go
``discovery/discovery_client.go`` ``downloadLegacy``/``downloadAPIs``; KEP-3352 keeps that fallback). The emulator
serves the legacy documents, built from the resources it serves, with the verbs, short names and categories the
real server lists for them (``pkg/registry/.../storage``: ``ShortNames()``, ``Categories()``).
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]

#: resource -> (verbs, short names, categories); a resource not listed gets the read verbs.
_READ = ["get", "list", "watch"]
_ALL = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
RESOURCE_DETAILS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "namespaces": (["create", "delete", "get", "list", "patch", "update", "watch"], ["ns"], []),
    "serviceaccounts": (_ALL, ["sa"], []),
    "pods": (_ALL, ["po"], ["all"]),
    "events": (_ALL, ["ev"], []),
    "nodes": (["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"], ["no"], []),
    "jobs": (_ALL, [], ["all"]),
}
#: Subresources the emulator serves: (parent, subresource, kind, verbs).
SUBRESOURCES: list[tuple[str, str, str, list[str]]] = [
    ("pods", "log", "Pod", ["get"]),
    ("pods", "status", "Pod", ["get", "patch", "update"]),
    ("pods", "eviction", "Eviction", ["create"]),
    ("jobs", "status", "Job", ["get", "patch", "update"]),
]
#: Groups served beyond those of the resources: group -> [(resource, kind, namespaced, verbs)].
EXTRA_GROUPS: dict[str, list[tuple[str, str, bool, list[str]]]] = {
    "authorization.k8s.io": [("selfsubjectaccessreviews", "SelfSubjectAccessReview", False, ["create"])],
}


def api_versions(server_address: str) -> Obj:
    """``/api``: the core group's versions."""
    return {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}]}


def _groups(resources: dict[str, tuple[str, str, str, bool]]) -> list[str]:
    named = [group for group, _, _, _ in resources.values() if group]
    return list(dict.fromkeys([*named, *EXTRA_GROUPS]))


def api_groups(resources: dict[str, tuple[str, str, str, bool]]) -> Obj:
    """``/apis``: every named group with its one version, ``v1``."""
    def group(name: str) -> Obj:
        version = {"groupVersion": f"{name}/v1", "version": "v1"}
        return {"name": name, "versions": [version], "preferredVersion": version}
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [group(g) for g in _groups(resources)]}


def resource_list(group: str, resources: dict[str, tuple[str, str, str, bool]]) -> Obj | None:
    """``/api/v1`` (group ``""``) or ``/apis/<group>/v1``: the group version's resources, or None if not served."""
    if group and group not in _groups(resources):
        return None
    items: list[Obj] = []
    for name, (res_group, _, kind, namespaced) in resources.items():
        if res_group != group:
            continue
        verbs, short, categories = RESOURCE_DETAILS.get(name, (_READ, [], []))
        entry: Obj = {"name": name, "singularName": kind.lower(), "namespaced": namespaced, "kind": kind,
                      "verbs": verbs}
        if short:
            entry["shortNames"] = short
        if categories:
            entry["categories"] = categories
        items.append(entry)
        for parent, sub, sub_kind, sub_verbs in SUBRESOURCES:
            if parent == name:
                items.append({"name": f"{name}/{sub}", "singularName": "", "namespaced": namespaced,
                              "kind": sub_kind, "verbs": sub_verbs, **({"group": "policy", "version": "v1"}
                                                                      if sub == "eviction" else {})})
    for name, kind, namespaced, verbs in EXTRA_GROUPS.get(group, []):
        items.append({"name": name, "singularName": kind.lower(), "namespaced": namespaced, "kind": kind,
                      "verbs": verbs})
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/v1" if group else "v1",
            "resources": items}


__all__ = ["api_groups", "api_versions", "resource_list"]

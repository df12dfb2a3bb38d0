"""The dozen Kubernetes API calls the backend makes, without importing the client's generated API classes.

Why: ``kubernetes.client.CoreV1Api`` lives in a 4.5 MB module, and importing it with ``BatchV1Api`` costs about
half a second of CPU in every command that talks to a cluster (``status``, ``logs``, ``cancel``, each poll's
first look), for calls whose paths are the stable core/v1 and batch/v1 API. The backend reads raw answers
(``_preload_content=False``) and parses the JSON itself, so the classes' models are never used either.

Each method builds its request as the generated method of the same name does (path, query names, ``Accept`` and
``Content-Type`` chosen by the client's own rules, bearer-token auth) through the client's ``param_serialize`` and
``call_api``, and raises the same ``ApiException`` for an answer outside 2xx. A client without ``param_serialize``
(an older generator) gets the generated classes themselves: ``core_v1`` and ``batch_v1`` return those.
"""

from __future__ import annotations

from typing import Any

_ANSWERS = ["application/json", "application/yaml", "application/vnd.kubernetes.protobuf", "application/cbor"]
_PATCHES = ["application/json-patch+json", "application/merge-patch+json", "application/strategic-merge-patch+json",
            "application/apply-patch+yaml", "application/apply-patch+cbor"]
#: Python keyword -> query parameter, for the options the backend passes.
_QUERY = {"label_selector": "labelSelector", "field_selector": "fieldSelector", "propagation_policy":
          "propagationPolicy", "grace_period_seconds": "gracePeriodSeconds", "container": "container",
          "follow": "follow", "timestamps": "timestamps", "since_seconds": "sinceSeconds", "tail_lines": "tailLines",
          "limit_bytes": "limitBytes", "previous": "previous"}


def core_v1(api_client: Any) -> Any:
    """The core/v1 calls (``CoreV1Api``'s names and arguments)."""
    if not hasattr(api_client, "param_serialize"):
        from kubernetes import client

        return client.CoreV1Api(api_client)
    return CoreV1(api_client)


def batch_v1(api_client: Any) -> Any:
    """The batch/v1 calls (``BatchV1Api``'s names and arguments)."""
    if not hasattr(api_client, "param_serialize"):
        from kubernetes import client

        return client.BatchV1Api(api_client)
    return BatchV1(api_client)


class _Calls:
    def __init__(self, api_client: Any) -> None:
        self.api = api_client

    def _call(self, method: str, path: str, params: dict[str, str], options: dict[str, Any], *,
              body: Any = None, answers: list[str] = _ANSWERS, content_types: list[str] | None = None) -> Any:
        """One request; its raw urllib3 response, as the generated method gives it with ``_preload_content=False``
        (what the backend always asks for: it parses the JSON itself; models are not offered here)."""
        from kubernetes.client.exceptions import ApiException

        if options.pop("_preload_content", True):
            raise TypeError(f"{method} {path}: only raw answers (_preload_content=False) are offered")
        timeout = options.pop("_request_timeout", None)
        unknown = set(options) - set(_QUERY)
        if unknown:
            raise TypeError(f"unsupported option(s) {sorted(unknown)} for {method} {path}")
        # In the API's order, which is the generated methods' order too: by name.
        query = sorted((_QUERY[name], value) for name, value in options.items() if value is not None)
        headers = {"Accept": self.api.select_header_accept(answers)}
        if body is not None and content_types:
            headers["Content-Type"] = self.api.select_header_content_type(content_types)
        request = self.api.param_serialize(method=method, resource_path=path, path_params=params,
                                           query_params=query, header_params=headers, body=body, post_params=[],
                                           files={}, auth_settings=["BearerToken"], collection_formats={})
        response = self.api.call_api(*request, _request_timeout=timeout)
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException.from_response(http_resp=response, body=None, data=None)
        return response.response


class BatchV1(_Calls):
    """Jobs: read, list, create, patch (a JSON patch), delete."""

    def read_namespaced_job(self, name: str, namespace: str, **options: Any) -> Any:
        return self._call("GET", "/apis/batch/v1/namespaces/{namespace}/jobs/{name}",
                          {"name": name, "namespace": namespace}, options)

    def list_namespaced_job(self, namespace: str, **options: Any) -> Any:
        return self._call("GET", "/apis/batch/v1/namespaces/{namespace}/jobs", {"namespace": namespace}, options)

    def create_namespaced_job(self, namespace: str, body: Any, **options: Any) -> Any:
        return self._call("POST", "/apis/batch/v1/namespaces/{namespace}/jobs", {"namespace": namespace}, options,
                          body=body)  # no Content-Type named: the client sends JSON

    def patch_namespaced_job(self, name: str, namespace: str, body: Any, **options: Any) -> Any:
        return self._call("PATCH", "/apis/batch/v1/namespaces/{namespace}/jobs/{name}",
                          {"name": name, "namespace": namespace}, options, body=body, content_types=_PATCHES)

    def delete_namespaced_job(self, name: str, namespace: str, **options: Any) -> Any:
        return self._call("DELETE", "/apis/batch/v1/namespaces/{namespace}/jobs/{name}",
                          {"name": name, "namespace": namespace}, options)


class CoreV1(_Calls):
    """Pods, their logs and events, and nodes."""

    def list_namespaced_pod(self, namespace: str, **options: Any) -> Any:
        return self._call("GET", "/api/v1/namespaces/{namespace}/pods", {"namespace": namespace}, options)

    def delete_namespaced_pod(self, name: str, namespace: str, **options: Any) -> Any:
        return self._call("DELETE", "/api/v1/namespaces/{namespace}/pods/{name}",
                          {"name": name, "namespace": namespace}, options)

    def read_namespaced_pod_log(self, name: str, namespace: str, **options: Any) -> Any:
        return self._call("GET", "/api/v1/namespaces/{namespace}/pods/{name}/log",
                          {"name": name, "namespace": namespace}, options, answers=["text/plain", *_ANSWERS])

    def list_namespaced_event(self, namespace: str, **options: Any) -> Any:
        return self._call("GET", "/api/v1/namespaces/{namespace}/events", {"namespace": namespace}, options)

    def read_node(self, name: str, **options: Any) -> Any:
        return self._call("GET", "/api/v1/nodes/{name}", {"name": name}, options)

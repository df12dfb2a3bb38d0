"""Talking to the API server: the kubeconfig, a sized client, one-line errors from API failures."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from diloco.errors import BackendError, ConfigError

if TYPE_CHECKING:
    pass

#: Labels and annotations diloco puts on the Job and its pods.
from diloco.executors.kubernetes.config import KubernetesBackendConfig
from diloco.executors.kubernetes.pods import _container_state, parse_time


# ---------------------------------------------------------------------------------------------- plumbing
def _timing(pod: Mapping[str, Any] | None) -> dict[str, float | None]:
    """``started_at`` / ``ended_at`` of the latest attempt's container."""
    if pod is None:
        return {}
    state = _container_state(pod)
    inner = state.get("running") or state.get("terminated") or {}
    return {"started_at": parse_time(inner.get("startedAt")), "ended_at": parse_time(
        (state.get("terminated") or {}).get("finishedAt"))}


def _lines(response: Any) -> Iterator[str]:
    """Complete lines from a (possibly streaming) ``text/plain`` answer; a last line without ``\\n`` too."""
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode(errors="replace")
    if buffer:
        yield buffer.decode(errors="replace")


def _status_of(exc: BaseException) -> int | None:
    """The HTTP status behind a translated error (None when the API never answered)."""
    cause = exc.__cause__
    status = getattr(cause, "status", None)
    return int(status) if isinstance(status, int) and status > 0 else None


def load_api_client(kubeconfig: str | None, context: str | None) -> Any:
    """An ApiClient from a kubeconfig (the given file, else ``$KUBECONFIG``, else ``~/.kube/config``) and context,
    or from the in-cluster service account when there is no kubeconfig inside a pod; ``ConfigError`` otherwise."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    path = os.path.expanduser(kubeconfig) if kubeconfig else None
    default = os.path.expanduser(os.environ.get("KUBECONFIG", "~/.kube/config").split(os.pathsep)[0])
    if path is None and not os.path.exists(default) and os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException as exc:
            raise ConfigError(f"backend.kubeconfig: no kubeconfig and the in-cluster config is unusable: {exc}",
                              hint="set backend.kubeconfig or KUBECONFIG") from exc
        return _sized(configuration)
    where = path or default
    if not os.path.exists(where):
        raise ConfigError(f"backend.kubeconfig: {where} does not exist",
                          hint="run `aws eks update-kubeconfig --name <cluster> --region <region>`, or point "
                               "KUBECONFIG / backend.kubeconfig at your kubeconfig")
    configuration = client.Configuration()
    try:
        config.load_kube_config(config_file=where, context=context, client_configuration=configuration,
                                persist_config=False)
    except ConfigException as exc:
        field = "backend.kube_context" if context else "backend.kubeconfig"
        raise ConfigError(f"{field}: {where} is not usable{f' with context {context!r}' if context else ''}: "
                          f"{' '.join(str(exc).split())}",
                          hint="list contexts with `kubectl config get-contexts`; pass --context") from exc
    return _sized(configuration)


def _sized(configuration: Any) -> Any:
    """An ApiClient with enough pooled connections for one followed log per replica plus the polling."""
    from kubernetes import client

    configuration.connection_pool_maxsize = 64
    return client.ApiClient(configuration)


def api_error(exc: BaseException, action: str, config: KubernetesBackendConfig | None = None) -> BackendError:
    """One line for a failed API call: the API's reason and message, or why the server could not be reached."""
    status = getattr(exc, "status", None)
    body = getattr(exc, "body", None)
    if isinstance(status, int) and status > 0:
        reason, message = str(getattr(exc, "reason", "") or status), ""
        try:
            parsed = json.loads(body) if body else {}
            reason, message = parsed.get("reason") or reason, parsed.get("message") or ""
        except (TypeError, ValueError):
            message = str(body or "").strip()
        hint = _hint(status, reason, message, config)
        error = BackendError(f"{action}: {reason}: {message}".rstrip(": "), hint=hint)
        return error
    import urllib3

    detail = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, (urllib3.exceptions.HTTPError, OSError)):
        return BackendError(f"{action}: {type(exc).__name__}: {detail}")
    host = ""
    try:
        host = f" at {exc.pool.host}:{exc.pool.port}"  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return BackendError(f"{action}: the Kubernetes API{host} is unreachable: {type(exc).__name__}: {detail}",
                        hint="check the cluster endpoint and your network/VPN, and that `kubectl get ns` works "
                             "with the same kubeconfig and context")


def _hint(status: int, reason: str, message: str, config: KubernetesBackendConfig | None) -> str | None:
    namespace = config.namespace if config else "<namespace>"
    if status == 401:
        return "your cluster credentials are missing or expired: `aws eks update-kubeconfig --name <cluster>`"
    if status == 403 and "exceeded quota" in message:
        return f"free capacity in namespace {namespace}'s ResourceQuota, or lower backend.cpu/backend.memory"
    if status == 403 and "admission webhook" in message:
        return "a policy in the cluster refused the Job; the message says which and why"
    if status == 403:
        return (f"ask for RBAC permission to create/get/delete/patch jobs.batch and get/list/delete pods, pods/log "
                f"and events in namespace {namespace} (`diloco doctor --backend eks` checks them)")
    if status == 404 and "namespaces" in message:
        return f"create it (`kubectl create namespace {namespace}`) or pass --namespace"
    if status == 409:
        return "a Job of this run exists already: `diloco cancel` it, or launch again for a new run id"
    if status == 422:
        return "the cluster refused the Job's manifest; see `diloco launch --dry-run -o json`"
    return None



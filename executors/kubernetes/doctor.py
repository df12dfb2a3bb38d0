"""``diloco doctor --backend eks``: context and server, namespace, service account (IRSA / Pod Identity), RBAC, image."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError

if TYPE_CHECKING:
    from diloco.executors.checks import Check, DoctorContext

#: Labels and annotations diloco puts on the Job and its pods.
from diloco.executors.kubernetes.api import api_error, load_api_client
from diloco.executors.kubernetes.config import (
    GPU_RESOURCE,
    INSTALL_HINT,
    IRSA_ANNOTATION,
    MIN_KUBERNETES,
    TIMEOUT,
    image_reference_error,
)

# ---------------------------------------------------------------------------------------------- doctor
#: What the backend does in a namespace, as (verb, group, resource, subresource).
PERMISSIONS = [("create", "batch", "jobs", ""), ("get", "batch", "jobs", ""), ("delete", "batch", "jobs", ""),
               ("patch", "batch", "jobs", ""), ("list", "", "pods", ""), ("delete", "", "pods", ""),
               ("get", "", "pods", "log"), ("list", "", "events", "")]


def check_cluster(ctx: DoctorContext) -> list[Check]:
    """Client, context, API server, namespace, service account (IRSA or Pod Identity) and RBAC, in order; a
    failure skips what depends on it."""
    from diloco.executors.checks import Check, Status, skip_check

    names = ("kubernetes client", "kubernetes context", "kubernetes API", "kubernetes namespace", "service account",
             "kubernetes permissions", NODES_CHECK)
    try:
        import kubernetes
    except ImportError:
        return [Check(name=names[0], status=Status.FAIL, detail="the kubernetes package is not installed",
                      fix=INSTALL_HINT), *(skip_check(n, "no kubernetes client") for n in names[1:])]
    checks = [Check(name=names[0], status=Status.PASS, detail=f"kubernetes {kubernetes.__version__}")]
    namespace = ctx.option("namespace") or "default"
    try:
        api = load_api_client(ctx.option("kubeconfig"), ctx.option("kube_context"))
    except ConfigError as exc:
        return [*checks, Check(name=names[1], status=Status.FAIL, detail=str(exc), fix=exc.hint),
                *(skip_check(n, "no usable kubeconfig context") for n in names[2:])]
    host = api.configuration.host
    checks.append(Check(name=names[1], status=Status.PASS, detail=f"{_context_name(ctx)} -> {host}"))
    server = _check_server(api, host)
    checks.append(server)
    if server.status == Status.FAIL:
        return [*checks, *(skip_check(n, "the API server is not usable") for n in names[3:])]
    checks.append(_check_namespace(api, namespace))
    checks.append(_check_service_account(ctx, api, namespace))
    checks.append(_check_permissions(api, namespace))
    checks.append(check_nodes(ctx, api))
    return checks


def _context_name(ctx: DoctorContext) -> str:
    from kubernetes import config

    if ctx.option("kube_context"):
        return f"context {ctx.option('kube_context')}"
    try:
        _, active = config.list_kube_config_contexts(config_file=ctx.option("kubeconfig"))
        return f"context {active['name']}"
    except Exception:  # noqa: BLE001 - in-cluster, or an unusual kubeconfig
        return "in-cluster config"


def _check_server(api: Any, host: str) -> Check:
    from kubernetes import client

    from diloco.executors.checks import Check, Status

    name = "kubernetes API"
    try:
        info = json.loads(client.VersionApi(api).get_code(_preload_content=False, _request_timeout=TIMEOUT).data)
    except Exception as exc:  # noqa: BLE001
        error = api_error(exc, f"GET {host}/version")
        return Check(name=name, status=Status.FAIL, detail=str(error), fix=error.hint or "check the cluster endpoint")
    version = str(info.get("gitVersion", "?"))
    found = re.match(r"v?(\d+)\.(\d+)", version)
    if found and (int(found.group(1)), int(found.group(2))) < MIN_KUBERNETES:
        return Check(name=name, status=Status.FAIL, detail=f"Kubernetes {version} at {host} is older than "
                     f"{'.'.join(map(str, MIN_KUBERNETES))} (backoffLimitPerIndex, FailIndex)",
                     fix="upgrade the cluster (EKS: a supported Kubernetes version)")
    return Check(name=name, status=Status.PASS, detail=f"Kubernetes {version} at {host}")


def _check_namespace(api: Any, namespace: str) -> Check:
    from kubernetes import client

    from diloco.executors.checks import Check, Status

    name = "kubernetes namespace"
    try:
        client.CoreV1Api(api).read_namespace(namespace, _preload_content=False, _request_timeout=TIMEOUT)
    except Exception as exc:  # noqa: BLE001
        status = getattr(exc, "status", None)
        if status == 404:
            return Check(name=name, status=Status.FAIL, detail=f"namespace {namespace!r} does not exist",
                         fix=f"kubectl create namespace {namespace} (or pass --namespace)")
        if status == 403:
            return Check(name=name, status=Status.WARN, detail=f"not allowed to read namespace {namespace!r}; it "
                         "may still be usable", fix="the permissions row below says what is missing")
        return Check(name=name, status=Status.FAIL, detail=str(api_error(exc, "read namespace")), fix=None)
    return Check(name=name, status=Status.PASS, detail=f"{namespace!r} exists")


def _check_service_account(ctx: DoctorContext, api: Any, namespace: str) -> Check:
    """The pods' identity for S3: an IRSA role annotation, or an EKS Pod Identity association."""
    from kubernetes import client

    from diloco.executors.checks import Check, Status

    name = "service account"
    account = ctx.option("service_account")
    if not account:
        return Check(name=name, status=Status.WARN,
                     detail="backend.service_account is not set: replicas run as 'default', which usually has no "
                            "AWS credentials for the rendezvous bucket",
                     fix="create a service account with IRSA or EKS Pod Identity and set backend.service_account")
    try:
        found = json.loads(client.CoreV1Api(api).read_namespaced_service_account(
            account, namespace, _preload_content=False, _request_timeout=TIMEOUT).data)
    except Exception as exc:  # noqa: BLE001
        if getattr(exc, "status", None) == 404:
            return Check(name=name, status=Status.FAIL,
                         detail=f"service account {account!r} does not exist in namespace {namespace!r}",
                         fix=f"eksctl create iamserviceaccount --name {account} --namespace {namespace} --cluster "
                             f"<cluster> --attach-policy-arn <s3-policy-arn> --approve")
        return Check(name=name, status=Status.WARN, detail=str(api_error(exc, f"read service account {account}")))
    role = ((found.get("metadata") or {}).get("annotations") or {}).get(IRSA_ANNOTATION)
    if role:
        return Check(name=name, status=Status.PASS, detail=f"{account!r}: IRSA role {role}")
    association = _pod_identity(ctx, api, namespace, account)
    if association:
        return Check(name=name, status=Status.PASS, detail=f"{account!r}: EKS Pod Identity {association}")
    return Check(name=name, status=Status.FAIL if association is not None else Status.WARN,
                 detail=f"{account!r} has no {IRSA_ANNOTATION} annotation" + (
                     " and no EKS Pod Identity association" if association is not None else
                     "; EKS Pod Identity could not be checked (not an EKS context, or no access to the EKS API)"),
                 fix=f"kubectl annotate serviceaccount {account} -n {namespace} {IRSA_ANNOTATION}=<role-arn>, or "
                     f"aws eks create-pod-identity-association --cluster-name <cluster> --namespace {namespace} "
                     f"--service-account {account} --role-arn <role-arn>")


def _pod_identity(ctx: DoctorContext, api: Any, namespace: str, account: str) -> str | None:
    """The Pod Identity association of the service account: its id and role, "" if there is none, None if the
    EKS API cannot tell (the context is not an EKS cluster, or no credentials)."""
    found = re.search(r"arn:aws[a-z-]*:eks:(?P<region>[a-z0-9-]+):\d{12}:cluster/(?P<name>[\w.-]+)",
                      _current_cluster(ctx))
    if not found:
        return None
    try:
        eks = ctx.client("eks", region=found.group("region"))
        items = eks.list_pod_identity_associations(clusterName=found.group("name"), namespace=namespace,
                                                   serviceAccount=account).get("associations", [])
        if not items:
            return ""
        detail = eks.describe_pod_identity_association(clusterName=found.group("name"),
                                                       associationId=items[0]["associationId"])["association"]
        return f"{items[0]['associationId']} (role {detail.get('roleArn')})"
    except Exception:  # noqa: BLE001
        return None


def _current_cluster(ctx: DoctorContext) -> str:
    """The kubeconfig cluster entry's name (``aws eks update-kubeconfig`` names it by the cluster's ARN)."""
    from kubernetes import config

    try:
        contexts, active = config.list_kube_config_contexts(config_file=ctx.option("kubeconfig"))
    except Exception:  # noqa: BLE001
        return ""
    wanted = ctx.option("kube_context")
    chosen = next((c for c in contexts if c["name"] == wanted), None) if wanted else active
    return str(((chosen or {}).get("context") or {}).get("cluster", ""))


def _check_permissions(api: Any, namespace: str) -> Check:
    """SelfSubjectAccessReview for everything the backend does in the namespace."""
    from kubernetes import client

    from diloco.executors.checks import Check, Status

    name = "kubernetes permissions"
    auth = client.AuthorizationV1Api(api)
    missing = []
    for verb, group, resource, sub in PERMISSIONS:
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview", "spec": {
            "resourceAttributes": {"namespace": namespace, "verb": verb, "group": group, "resource": resource,
                                   "subresource": sub}}}
        try:
            answer = json.loads(auth.create_self_subject_access_review(review, _preload_content=False,
                                                                       _request_timeout=TIMEOUT).data)
        except Exception as exc:  # noqa: BLE001
            return Check(name=name, status=Status.WARN, detail=str(api_error(exc, "SelfSubjectAccessReview")))
        if not (answer.get("status") or {}).get("allowed"):
            missing.append(f"{verb} {resource}{'/' + sub if sub else ''}{'.' + group if group else ''}")
    if missing:
        return Check(name=name, status=Status.FAIL, detail=f"not allowed in {namespace!r}: {', '.join(missing)}",
                     fix=f"kubectl create role diloco -n {namespace} --verb=create,get,list,watch,delete,patch "
                         f"--resource=jobs.batch,pods,pods/log,events; then bind it to you with `kubectl create "
                         f"rolebinding`")
    return Check(name=name, status=Status.PASS, detail=f"may create/delete Jobs and read pods and logs in "
                                                       f"{namespace!r}")


NODES_CHECK = "kubernetes nodes"


def check_nodes(ctx: DoctorContext, api: Any) -> Check:
    """The nodes a replica pod could run on now: its node selector, the GPU affinity of ``--gpu`` (with
    ``--procs-per-replica``), tolerated taints, and enough allocatable ``nvidia.com/gpu``. None matching is a
    warning, not a failure: Karpenter or the cluster autoscaler may add one on demand. Listing nodes needs
    cluster-scoped RBAC a namespaced user often lacks; then the row says so."""
    from kubernetes import client

    from diloco.executors.checks import Check, Status
    from diloco.executors.kubernetes.placement import describe_selector, gpu_terms_for, node_fits
    from diloco.executors.kubernetes.pods import replica_gpus

    try:
        gpus, product = replica_gpus(ctx.gpu, ctx.procs_per_replica)
    except ConfigError as exc:
        return Check(name=NODES_CHECK, status=Status.FAIL, detail=str(exc), fix=exc.hint)
    selector = dict(ctx.option("node_selector") or {})
    terms = gpu_terms_for(ctx.section, product, gpus) if product else None
    tolerations = list(ctx.option("tolerations") or [])
    if gpus:
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    wanted = describe_selector(selector, terms) + (f", with {gpus} allocatable {GPU_RESOURCE}" if gpus else "")
    try:
        found = json.loads(client.CoreV1Api(api).list_node(_preload_content=False, _request_timeout=TIMEOUT).data)
    except Exception as exc:  # noqa: BLE001
        why = "not allowed to list nodes (a cluster-scoped permission)" if getattr(exc, "status", None) == 403 \
            else str(api_error(exc, "list nodes"))
        return Check(name=NODES_CHECK, status=Status.WARN,
                     detail=f"{why}: cannot tell whether a node would take a replica ({wanted})",
                     fix="ask your cluster admin whether such nodes exist (or for `list nodes` through a ClusterRole)")
    nodes = found.get("items") or []
    matching = [n for n in nodes if node_fits(n, selector, terms, tolerations, gpus)]
    if not matching:
        return Check(name=NODES_CHECK, status=Status.WARN,
                     detail=f"none of the cluster's {len(nodes)} node(s) would take a replica now ({wanted}); the "
                            "pods would stay Pending and the launch fail after backend.pending_timeout_s",
                     fix="add such nodes (a GPU node group, a Karpenter NodePool: new ones may also be created on "
                         "demand), or change --gpu / backend.node_selector / backend.tolerations")
    shown = ", ".join(_node_name(n) for n in matching[:5]) + (f" and {len(matching) - 5} more"
                                                             if len(matching) > 5 else "")
    return Check(name=NODES_CHECK, status=Status.PASS,
                 detail=f"{len(matching)} of {len(nodes)} node(s) would take a replica ({wanted}): {shown}")


def _node_name(node: dict[str, Any]) -> str:
    meta = node.get("metadata") or {}
    kind = (meta.get("labels") or {}).get("node.kubernetes.io/instance-type")
    return f"{meta.get('name')} ({kind})" if kind else str(meta.get("name"))


def check_image_reference(ctx: DoctorContext) -> Check:
    """The image reference is well formed; an ECR image must also exist (``check_image``)."""
    from diloco.executors.checks import Check, Status, check_image

    image = ctx.option("image")
    if not image:
        from diloco.executors.kubernetes.code import DEFAULT_REPOSITORY

        return Check(name="training image", status=Status.PASS,
                     detail=f"no image given: the pods run AWS's public PyTorch image ({DEFAULT_REPOSITORY}, no "
                            "registry credentials needed) and the code channel (nothing to build)")
    error = image_reference_error(image)
    if error:
        return Check(name="training image", status=Status.FAIL, detail=error,
                     fix="e.g. <account>.dkr.ecr.<region>.amazonaws.com/diloco:latest (build it from "
                         "docker/Dockerfile)")
    return check_image(ctx, image)

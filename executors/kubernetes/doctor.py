"""``diloco doctor --backend eks``: context and server, namespace, service account (IRSA / Pod Identity), RBAC, the
nodes a replica would run on (their disk for the image, the GPU nodes' device plugin), image."""

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
             "kubernetes permissions", NODES_CHECK, DISK_CHECK, PLUGIN_CHECK)
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
    nodes = _list_nodes(api)
    checks.append(check_nodes(ctx, api, nodes))
    checks.append(check_node_disks(ctx, nodes))
    checks.append(check_device_plugin(ctx, nodes))
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


DISK_CHECK = "node disk"
PLUGIN_CHECK = "GPU device plugin"


def _list_nodes(api: Any) -> list[dict[str, Any]] | Exception:
    """Every node, or the exception listing them raised (a namespaced user often may not)."""
    from kubernetes import client

    try:
        found = json.loads(client.CoreV1Api(api).list_node(_preload_content=False, _request_timeout=TIMEOUT).data)
    except Exception as exc:  # noqa: BLE001 - the checks say what it means
        return exc
    return list(found.get("items") or [])


def _replica_nodes(ctx: DoctorContext, nodes: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """(GPUs per replica, the nodes that would take a replica now)."""
    from diloco.executors.kubernetes.placement import gpu_terms_for, node_fits
    from diloco.executors.kubernetes.pods import replica_gpus

    gpus, product = replica_gpus(ctx.gpu, ctx.procs_per_replica)
    terms = gpu_terms_for(ctx.section, product, gpus) if product else None
    tolerations = list(ctx.option("tolerations") or [])
    if gpus:
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return gpus, [n for n in nodes if node_fits(n, dict(ctx.option("node_selector") or {}), terms, tolerations,
                                                gpus)]


def check_node_disks(ctx: DoctorContext, nodes: list[dict[str, Any]] | Exception) -> Check:
    """The nodes a replica would run on have the disk its image needs (``code.min_disk_gib``: the unpacked image,
    its compressed layers and the kubelet's 10 % of free space), read from their ``ephemeral-storage`` capacity.
    Only AWS's PyTorch images have a known size; for another ``--image`` the check says so and passes on."""
    from diloco.executors.checks import Check, Status
    from diloco.executors.kubernetes.code import DEFAULT_IMAGE_MIB, disk_fix, image_unpacked_mib, min_disk_gib

    if isinstance(nodes, Exception):
        return Check(name=DISK_CHECK, status=Status.SKIP, detail="the nodes cannot be listed (see above)")
    try:
        gpus, matching = _replica_nodes(ctx, nodes)
    except ConfigError as exc:
        return Check(name=DISK_CHECK, status=Status.SKIP, detail=str(exc))
    image = ctx.option("image")
    mib = image_unpacked_mib(image) if image else DEFAULT_IMAGE_MIB["gpu" if gpus else "cpu"]
    if mib is None:
        return Check(name=DISK_CHECK, status=Status.PASS, detail=f"the size of {image} is not known here: it must "
                     "fit the nodes' disk twice over (compressed and unpacked) with 10% to spare")
    if not matching:
        return Check(name=DISK_CHECK, status=Status.SKIP, detail="no node would take a replica now (see above)")
    need = min_disk_gib(mib)
    what = f"the {'CUDA' if gpus else 'CPU'} image ({mib * 2**20 // 2**30} GiB unpacked) needs a {need} GiB disk"
    small = [(n, gib) for n in matching if (gib := _disk_gib(n)) is not None and gib < need]
    if not small:
        return Check(name=DISK_CHECK, status=Status.PASS,
                     detail=f"{what}; the {len(matching)} node(s) that would take a replica have it")
    shown = ", ".join(f"{_node_name(n)}: {gib:g} GiB" for n, gib in small[:5]) + (
        f" and {len(small) - 5} more" if len(small) > 5 else "")
    every = len(small) == len(matching)
    return Check(name=DISK_CHECK, status=Status.FAIL if every else Status.WARN,
                 detail=f"{what}; {'every' if every else 'some'} node that would take a replica has less ({shown}): "
                        "its pull fails with no space left on device and the node comes under DiskPressure",
                 fix=disk_fix(mib))


def _disk_gib(node: dict[str, Any]) -> float | None:
    """The node's ``ephemeral-storage`` capacity in GiB (one decimal), None when it reports none."""
    from diloco.executors.kubernetes.code import quantity_bytes

    raw = ((node.get("status") or {}).get("capacity") or {}).get("ephemeral-storage")
    try:
        return round(quantity_bytes(str(raw)) / 2**30, 1) if raw is not None else None
    except ValueError:
        return None


def _is_gpu_node(node: dict[str, Any]) -> bool:
    """Whether a node has NVIDIA GPUs by any stock label: an EC2 GPU instance type, Karpenter's or Auto Mode's GPU
    count, or GPU Feature Discovery's."""
    from diloco.executors.gpus import (
        AUTO_MODE_GPU_COUNT,
        GFD_COUNT,
        INSTANCE_TYPE_LABEL,
        KARPENTER_GPU_COUNT,
        gpu_of_instance,
    )

    labels = (node.get("metadata") or {}).get("labels") or {}
    if any(str(labels.get(k, "0")).isdigit() and int(labels.get(k, "0")) > 0
           for k in (KARPENTER_GPU_COUNT, AUTO_MODE_GPU_COUNT, GFD_COUNT)):
        return True
    return labels.get("nvidia.com/gpu.present") == "true" or gpu_of_instance(labels.get(INSTANCE_TYPE_LABEL, "")) \
        is not None


#: What makes a GPU node's GPUs schedulable: NVIDIA's device plugin DaemonSet (its README's Helm install).
DEVICE_PLUGIN_FIX = ("install the NVIDIA device plugin DaemonSet (`helm repo add nvdp https://nvidia.github.io/"
                     "k8s-device-plugin && helm upgrade -i nvdp nvdp/nvidia-device-plugin -n nvidia-device-plugin "
                     "--create-namespace`, or the NVIDIA GPU operator): the EKS AL2023 NVIDIA AMIs ship the driver "
                     "but not the plugin; Bottlerocket NVIDIA nodes and EKS Auto Mode include it")


def check_device_plugin(ctx: DoctorContext, nodes: list[dict[str, Any]] | Exception) -> Check:
    """Every GPU node advertises ``nvidia.com/gpu`` in its allocatable: only the NVIDIA device plugin does, and
    without it no pod can ask for the node's GPUs (EKS user guide, "NVIDIA device plugin for Kubernetes": the
    AL2023 accelerated AMIs need it installed; Bottlerocket and Auto Mode include it). A failure with ``--gpu``
    (its replicas would stay pending), a warning without."""
    from diloco.executors.checks import Check, Status
    from diloco.executors.kubernetes.placement import _allocatable

    if isinstance(nodes, Exception):
        return Check(name=PLUGIN_CHECK, status=Status.SKIP, detail="the nodes cannot be listed (see above)")
    gpu_nodes = [n for n in nodes if _is_gpu_node(n)]
    if not gpu_nodes:
        return Check(name=PLUGIN_CHECK, status=Status.SKIP, detail="no GPU node in the cluster now")
    missing = [n for n in gpu_nodes if _allocatable(n, GPU_RESOURCE) <= 0]
    if not missing:
        return Check(name=PLUGIN_CHECK, status=Status.PASS,
                     detail=f"the {len(gpu_nodes)} GPU node(s) advertise {GPU_RESOURCE}")
    shown = ", ".join(_node_name(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                                             else "")
    return Check(name=PLUGIN_CHECK, status=Status.FAIL if ctx.gpu else Status.WARN,
                 detail=f"{len(missing)} of {len(gpu_nodes)} GPU node(s) advertise no allocatable {GPU_RESOURCE}, "
                        f"so no pod can ask for their GPUs (the NVIDIA device plugin is not running there): {shown}",
                 fix=DEVICE_PLUGIN_FIX)


def check_nodes(ctx: DoctorContext, api: Any, nodes: list[dict[str, Any]] | Exception | None = None) -> Check:
    """The nodes a replica pod could run on now: its node selector, the GPU affinity of ``--gpu`` (with
    ``--procs-per-replica``), tolerated taints, and enough allocatable ``nvidia.com/gpu``. None matching is a
    warning, not a failure: Karpenter or the cluster autoscaler may add one on demand. Listing nodes needs
    cluster-scoped RBAC a namespaced user often lacks; then the row says so."""

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
    nodes = _list_nodes(api) if nodes is None else nodes
    if isinstance(nodes, Exception):
        exc = nodes
        why = "not allowed to list nodes (a cluster-scoped permission)" if getattr(exc, "status", None) == 403 \
            else str(api_error(exc, "list nodes"))
        return Check(name=NODES_CHECK, status=Status.WARN,
                     detail=f"{why}: cannot tell whether a node would take a replica ({wanted})",
                     fix="ask your cluster admin whether such nodes exist (or for `list nodes` through a ClusterRole)")
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

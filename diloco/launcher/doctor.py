"""`diloco doctor`: check, before launching, everything a launch on a backend needs, each failure with its fix.

Why: the expensive failures of a DiLoCo run happen late and far away. A replica job that cannot write to the
rendezvous prefix blocks every peer until the all-reduce timeout (30 minutes by default); an execution role whose
policies do not cover the bucket fails the same way, only after SageMaker has provisioned every instance. The
doctor finds these in seconds, from where you launch.

Rules it keeps:

* It only reads. The exceptions are probes, deleted again: a few objects under a fresh ``_diloco_doctor/<uuid>/``
  key under the prefix (only those keys, never anything else), and a temporary file in the run directory.
* Each check is a small function returning a ``Check``; a check that does not apply to the chosen backend is
  ``skip`` with the reason. ``warn`` means "could not prove it works, might still": it does not fail the run.
* boto3 and the Kubernetes client are imported inside the checks; clients get short timeouts and few retries.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from diloco.executors import DEFAULT_BACKEND
from diloco.executors.checks import (
    PROBE_DIR,
    Check,
    DoctorContext,
    Status,
    check_image,
    custom_endpoint,
    explain_aws_error,
    fail_check,
    skip_check,
)
from diloco.launcher.config import resolve_config

__all__ = ["PROBE_DIR", "Check", "DoctorContext", "DoctorReport", "Status", "check_image", "explain_aws_error",
           "fail_check", "run_doctor", "skip_check"]


class DoctorReport(BaseModel):
    """Every check, in order; ``ok`` is False when any check failed."""

    backend: str
    s3_uri: str | None = None
    checks: list[Check]
    ok: bool


def _failed(ctx: DoctorContext, name: str) -> bool:
    found = ctx.results.get(name)
    return found is not None and found.status == Status.FAIL


# ---------------------------------------------------------------------------------------------- checks
def check_credentials(ctx: DoctorContext) -> Check:
    name = "aws credentials"
    if ctx.file_store_ok and not ctx.s3_uri:
        return skip_check(name, "no --s3: replicas meet in a file:// store")
    try:
        ident = ctx.client("sts").get_caller_identity()
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row
        check = fail_check(name, exc, "sts:GetCallerIdentity")
        if ctx.file_store_ok and custom_endpoint() and "credentials" not in check.detail:
            # An S3-compatible store need not offer STS; the S3 checks below are what count.
            check.status = Status.WARN
        return check
    return Check(name=name, status=Status.PASS, detail=f"{ident.get('Arn')} (account {ident.get('Account')})")


def check_region(ctx: DoctorContext) -> Check:
    name = "aws region"
    if ctx.file_store_ok and not ctx.s3_uri:
        return skip_check(name, "no --s3: replicas meet in a file:// store")
    from diloco.store.aws_region import REGION_HINT

    try:
        region, source = ctx.resolved_region()
    except Exception as exc:  # noqa: BLE001 - e.g. AWS_PROFILE names a profile that does not exist
        return fail_check(name, exc, "a readable AWS config")
    if region:
        return Check(name=name, status=Status.PASS, detail=f"{region} (from {source})")
    return Check(name=name, status=Status.WARN if ctx.file_store_ok else Status.FAIL,
                 detail="no region configured (--region, AWS_REGION, AWS_DEFAULT_REGION and the profile name none)",
                 fix=f"{REGION_HINT}: the region of your bucket and jobs")


def check_bucket(ctx: DoctorContext) -> Check:
    name = "s3 bucket"
    if not ctx.s3_uri and not ctx.file_store_ok:
        return Check(name=name, status=Status.FAIL, detail=f"the {ctx.backend} backend needs an s3:// rendezvous",
                     fix="pass --s3 s3://<bucket>/<prefix>, or set store.rendezvous in the config or DILOCO_S3_URI")
    if not ctx.s3_uri:
        return skip_check(name, "no S3 URI (--s3, the config's store.rendezvous or DILOCO_S3_URI)")
    from botocore.exceptions import ClientError

    try:
        out = ctx.client("s3").head_bucket(Bucket=ctx.bucket)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        headers = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        if code in ("404", "NoSuchBucket", "NotFound"):
            return Check(name=name, status=Status.FAIL, detail=f"bucket {ctx.bucket!r} does not exist",
                         fix=f"create it (`aws s3 mb s3://{ctx.bucket}`) or fix the S3 URI")
        if code in ("403", "AccessDenied", "Forbidden"):
            return Check(name=name, status=Status.FAIL, detail=f"access to bucket {ctx.bucket!r} denied (403)",
                         fix=f"grant s3:ListBucket on arn:aws:s3:::{ctx.bucket} (and object access on the "
                             f"prefix) to the identity in use, or check the bucket policy")
        if code in ("301", "PermanentRedirect"):
            where = headers.get("x-amz-bucket-region", "another region")
            return Check(name=name, status=Status.FAIL, detail=f"bucket {ctx.bucket!r} is in {where}",
                         fix=f"pass --region {where} or set AWS_REGION={where} (run the jobs next to their bucket)")
        return fail_check(name, exc, f"s3:ListBucket on {ctx.bucket}")
    except Exception as exc:  # noqa: BLE001
        return fail_check(name, exc, f"s3:ListBucket on {ctx.bucket}")
    region = (out.get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}).get("x-amz-bucket-region")
    finding = _region_finding(ctx, region)
    if finding is not None:
        return Check(name=name, status=Status.FAIL if finding.refuse else Status.WARN, detail=finding.message,
                     fix=finding.fix)
    return Check(name=name, status=Status.PASS, detail=f"{ctx.bucket!r} reachable" + (f" ({region})" if region else ""))


def _region_finding(ctx: DoctorContext, bucket_region: str | None) -> Any:
    """The bucket's region against where the jobs run (``executors.checks.region_finding``), the first part that
    is refused winning over one only warned; None when they agree. A run split over backends: each part's
    ``region`` setting, else the region this shell resolves."""
    from diloco.executors.checks import region_finding

    parts = ctx.option("parts") if ctx.backend == "mixed" else None
    sections = [p.model_dump() if hasattr(p, "model_dump") else p for p in parts or []]
    places = [(f"backend.parts[{i}].region", str(p.get("kind", "")), p.get("region") or ctx.region)
              for i, p in enumerate(sections) if isinstance(p, dict)] or \
        [("backend.region", ctx.backend, ctx.region)]
    found = [f for where, kind, region in places
             if (f := region_finding(kind, region, ctx.bucket or "", bucket_region, where)) is not None]
    return next((f for f in found if f.refuse), found[0] if found else None)


def check_read_write(ctx: DoctorContext) -> list[Check]:
    """put/get/list/delete and conditional create on a fresh probe key under the prefix, through ObjectStore."""
    rw, cc = "s3 read/write", "s3 conditional create"
    if not ctx.s3_uri:
        return [skip_check(rw, "no S3 URI"), skip_check(cc, "no S3 URI")]
    if _failed(ctx, "s3 bucket"):
        return [skip_check(rw, "bucket not reachable (see above)"), skip_check(cc, "bucket not reachable (see above)")]
    from diloco.store.objects import ObjectStore, probe_conditional_create

    probe_dir = "/".join(p for p in (ctx.prefix, PROBE_DIR, uuid.uuid4().hex) if p)
    store = ObjectStore(f"s3://{ctx.bucket}/{probe_dir}", retries=1, backoff_s=0.2)
    written: list[str] = []
    step = "put"
    try:
        payload = os.urandom(64)
        store.put("probe", payload)
        written.append("probe")
        step = "get"
        if store.get("probe") != payload:
            return [Check(name=rw, status=Status.FAIL, detail="read back different bytes than written",
                          fix="the store does not return what it stored; use AWS S3 or a conformant store"),
                    skip_check(cc, "read/write failed")]
        step = "list"
        if store.list() != ["probe"]:
            return [Check(name=rw, status=Status.FAIL, detail=f"listing shows {store.list()}, expected ['probe']",
                          fix="the store's listing is not consistent with its writes"), skip_check(cc, "read/write failed")]
        step = "delete"
        store.delete("probe")
        written.remove("probe")
        if store.exists("probe"):
            return [Check(name=rw, status=Status.FAIL, detail="a deleted object still exists",
                          fix="grant s3:DeleteObject on the prefix"), skip_check(cc, "read/write failed")]
        rw_check = Check(name=rw, status=Status.PASS, detail=f"put/get/list/delete under {store.url()}")
        step = "conditional create"
        honoured, detail = probe_conditional_create(store, "lease")  # the probe `diloco launch` runs too
        if honoured:
            cc_check = Check(name=cc, status=Status.PASS, detail=detail)
        else:
            cc_check = Check(name=cc, status=Status.FAIL, detail=detail,
                             fix="use AWS S3 or a store with conditional writes; and s3fs >= 2025.7")
        return [rw_check, cc_check]
    except Exception as exc:  # noqa: BLE001
        detail = f"{step} failed: {type(exc).__name__}: {exc}"
        hint = getattr(exc, "hint", None) or explain_aws_error(exc, "s3:GetObject/PutObject/DeleteObject")[1]
        failed = Check(name=rw if step != "conditional create" else cc, status=Status.FAIL, detail=detail, fix=hint)
        return [failed, skip_check(cc, "read/write failed")] if failed.name == rw else [rw_check, failed]
    finally:
        for key in written:  # only what we wrote
            try:
                store.delete(key)
            except Exception:  # noqa: BLE001 - reported by the checks above when it matters
                pass


def check_run_directory(ctx: DoctorContext) -> Check:
    """Where runs are recorded (and local replicas log and meet): writable, with room to spare. Creates nothing
    that was not there: a missing directory is judged by its nearest existing parent."""
    import shutil
    import tempfile

    from diloco.launcher.runs import runs_dir

    name = "run directory"
    target = runs_dir()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return Check(name=name, status=Status.FAIL, detail=f"{existing} is not a directory",
                     fix="set DILOCO_HOME to a writable directory")
    try:
        if existing == target:
            with tempfile.NamedTemporaryFile(dir=target, prefix=".doctor-"):
                pass
        elif not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(f"{existing} is not writable")
    except OSError as exc:
        return Check(name=name, status=Status.FAIL, detail=f"cannot write under {target}: {exc}",
                     fix="set DILOCO_HOME to a writable directory")
    free_gb = shutil.disk_usage(existing).free / 2**30
    detail = f"{target} writable{'' if existing == target else ' (will be created)'}, {free_gb:.1f} GiB free"
    if free_gb < 1:
        return Check(name=name, status=Status.WARN, detail=detail,
                     fix="free some space, or set DILOCO_HOME elsewhere: local runs keep logs and the store there")
    return Check(name=name, status=Status.PASS, detail=detail)


#: In order; each takes the context and returns one check or several.
CHECKS: list[Callable[[DoctorContext], Check | list[Check]]] = [
    check_run_directory, check_credentials, check_region, check_bucket, check_read_write,
]


# ---------------------------------------------------------------------------------------------- entry
def resolve_inputs(
    *, backend: str | None, s3_uri: str | None, config_path: str | None, options: dict[str, Any] | None = None,
    gpu: str | None = None, procs_per_replica: int | None = None,
) -> DoctorContext:
    """Flags win over the run config; ``ConfigError`` (exit 2) for a bad backend, URI or config.

    ``options`` are flag values for the backend's config fields (e.g. ``{"role_arn": ...}``); a flag a backend
    has no field for is ignored, so one ``--image`` serves backends that call the field differently.
    """
    from diloco.store.s3 import resolve_s3_uri

    cfg = resolve_config(config_path) if config_path is not None else None
    kind = backend or (cfg.backend.kind if cfg is not None else DEFAULT_BACKEND)
    data: dict[str, Any] = cfg.backend.model_dump(exclude={"kind"}) if cfg is not None and cfg.backend.kind == kind else {}
    data.update({k: v for k, v in (options or {}).items() if v is not None})
    # The section stays unvalidated on purpose: the doctor reports what is missing, row by row.
    ctx = DoctorContext.for_backend(kind, resolve_s3_uri(s3_uri, cfg.store.rendezvous if cfg else None), **data)
    ctx.gpu = gpu if gpu is not None else (cfg.gpu if cfg is not None else None)
    ctx.procs_per_replica = procs_per_replica if procs_per_replica is not None else (
        cfg.train.procs_per_replica if cfg is not None else None)
    return ctx


def run_doctor(ctx: DoctorContext) -> DoctorReport:
    """Run every common check, then the backend's own, in order (later checks may read earlier results)."""
    from diloco.executors import backend_class

    checks: list[Check] = []
    steps: list[Callable[[DoctorContext], Check | list[Check]]] = [
        *CHECKS, backend_class(ctx.backend).doctor_checks]
    for fn in steps:
        try:
            out = fn(ctx)
        except Exception as exc:  # noqa: BLE001 - a broken check is a failed row, not a crash
            out = Check(name=getattr(fn, "__name__", "check").removeprefix("check_").replace("_", " "),
                        status=Status.FAIL, detail=f"the check itself failed: {type(exc).__name__}: {exc}",
                        fix="set DILOCO_DEBUG=1 and report it")
        for check in out if isinstance(out, list) else [out]:
            ctx.results[check.name] = check
            checks.append(check)
    return DoctorReport(backend=ctx.backend, s3_uri=ctx.s3_uri, checks=checks,
                        ok=not any(c.status == Status.FAIL for c in checks))

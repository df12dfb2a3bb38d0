"""``diloco doctor --backend mixed``: every part's own checks, then whether each part's identity can use the run's
one store: the SageMaker execution role, the EKS service account's role, this machine's credentials.

The common checks (credentials, region, bucket, read/write and conditional create under the S3 prefix) run first,
as this machine; then, per part, its backend's ``doctor_checks`` with the part's section, each row named
``parts[i] <kind>: <check>``, and last an identity row per part.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from diloco.executors.mixed.config import parse_part

if TYPE_CHECKING:
    from diloco.executors.checks import Check, DoctorContext

#: An IAM role's ARN inside a check's detail (the service account row names the role its pods run as).
_ROLE_ARN = re.compile(r"arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+")
#: The common checks whose result says whether this machine's credentials can use the store.
_READ_WRITE = "s3 read/write"

__all__ = ["part_checks"]


def part_checks(ctx: DoctorContext) -> list[Check]:
    """Each part's checks and its identity row, in part order; one failed row when the parts cannot be read."""
    from diloco.executors.checks import Check, Status

    raw = ctx.option("parts")
    if not isinstance(raw, (list, tuple)) or not raw:
        return [Check(name="parts", status=Status.FAIL, detail="no parts given",
                      fix="pass --part KIND:N for each part (e.g. --part eks:2 --part local:1), or -c with a "
                          "config whose backend.parts lists them")]
    checks: list[Check] = []
    for i, item in enumerate(raw):
        try:
            section = parse_part(item.model_dump() if hasattr(item, "model_dump") else item, f"backend.parts[{i}]")
        except ValueError as exc:
            checks.append(Check(name=f"parts[{i}]", status=Status.FAIL, detail=str(exc),
                                fix="write each part as KIND:N or as a backend section with its replicas"))
            continue
        checks += _checks_of_part(ctx, i, section)
    return checks


def _checks_of_part(ctx: DoctorContext, index: int, section: dict[str, Any]) -> list[Check]:
    from diloco.errors import ConfigError
    from diloco.executors import backend_class
    from diloco.executors.checks import Check, DoctorContext, Status

    kind = str(section.get("kind"))
    label = f"parts[{index}] {kind}"
    options = {k: v for k, v in section.items() if k not in ("kind", "replicas")}
    try:
        cls = backend_class(kind)
        sub = DoctorContext.for_backend(kind, ctx.s3_uri, **options)
    except ConfigError as exc:
        return [Check(name=label, status=Status.FAIL, detail=str(exc), fix=exc.hint)]
    sub.gpu, sub.procs_per_replica = ctx.gpu, ctx.procs_per_replica
    sub.results = dict(ctx.results)  # the common rows (bucket, read/write) for checks that depend on them
    rows: list[Check] = []
    try:
        found = cls.doctor_checks(sub)
    except Exception as exc:  # noqa: BLE001 - a broken check is a failed row, not a crash
        found = [Check(name="checks", status=Status.FAIL, detail=f"the check itself failed: {type(exc).__name__}: "
                       f"{exc}", fix="set DILOCO_DEBUG=1 and report it")]
    for check in found:
        sub.results[check.name] = check
        rows.append(check.model_copy(update={"name": f"{label}: {check.name}"}))
    rows.append(_identity(sub, kind, label))
    return rows


def _identity(sub: DoctorContext, kind: str, label: str) -> Check:
    """Whether the identity this part's replicas run as can read and write the run's S3 prefix."""
    from diloco.executors.checks import Check, Status, skip_check

    name = f"{label}: identity can use the store"
    if not sub.s3_uri:
        return skip_check(name, "no S3 URI (--s3, the config's store.rendezvous or DILOCO_S3_URI)")
    if kind == "sagemaker":
        found = sub.results.get("role can reach bucket")
        if found is None:
            return skip_check(name, "no execution role checked")
        return found.model_copy(update={"name": name, "detail": f"the execution role: {found.detail}"})
    if kind == "eks":
        account = sub.results.get("service account")
        if account is None or account.status != Status.PASS:
            return skip_check(name, "the pods' service account is not usable (see its row above)")
        role = _ROLE_ARN.search(account.detail)
        if role is None:
            return Check(name=name, status=Status.WARN, detail=f"could not tell the role of {account.detail}",
                         fix="check that role's policies grant s3:GetObject/PutObject/DeleteObject/ListBucket on "
                             "the prefix")
        from diloco.executors.sagemaker.doctor import check_role_reaches_bucket

        found = check_role_reaches_bucket(sub, role.group(0), name)
        return found.model_copy(update={"detail": f"the service account's role: {found.detail}"})
    on_this_machine = sub.section is not None and not sub.section.places_some_replicas()
    if on_this_machine:
        common = sub.results.get(_READ_WRITE)
        if common is None:
            return skip_check(name, "the store's read/write check did not run")
        status = Status.PASS if common.status == Status.PASS else Status.FAIL
        return Check(name=name, status=status, detail=f"replicas here use this machine's credentials: "
                                                      f"{_READ_WRITE} {common.status.value}",
                     fix=None if status == Status.PASS else "see the s3 read/write row above")
    return skip_check(name, f"diloco cannot tell which identity {kind}'s replicas run as; check it can read and "
                            f"write the prefix")

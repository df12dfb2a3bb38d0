"""The account's SageMaker instance quotas (Service Quotas), read before anything is created.

Why before: SageMaker refuses the CreateTrainingJob that goes over "<type> for training job usage" with
ResourceLimitExceeded, so a launch of 40 replicas against a quota of 32 creates 32 jobs, is refused at the 33rd, and
then stops and waits for all 32 (a stopped job keeps its instance up to 120 s). Reading the quota first refuses that
launch in one line with nothing created. The check is best effort: when the quotas cannot be read (no
``servicequotas:ListServiceQuotas``, an endpoint that is not Service Quotas, no network) the launch goes on and
SageMaker's own refusal remains the backstop, as before.

Jobs already running on the same type count against the quota too; they are not counted here, because the only way
to find them walks the account's whole job history (``ListTrainingJobs`` filters after paging) and describes each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.errors import ConfigError

#: ListServiceQuotas' largest page.
PAGE_SIZE = 100


@dataclass(frozen=True)
class Quota:
    """One of the account's SageMaker quotas, as Service Quotas lists it."""

    name: str
    code: str | None
    value: float


def quota_name(instance_type: str, *, spot: bool = False) -> str:
    """The Service Quotas name of the training quota of ``instance_type`` (managed spot jobs have their own)."""
    return f"{instance_type} for {'spot ' if spot else ''}training job usage"


def read_quotas(client: Any) -> dict[str, Quota]:
    """Every SageMaker quota of the account by name (every page of ListServiceQuotas). Errors propagate."""
    found: dict[str, Quota] = {}
    token: str | None = None
    while True:
        page = client.list_service_quotas(ServiceCode="sagemaker", MaxResults=PAGE_SIZE,
                                          **({"NextToken": token} if token else {}))
        for item in page.get("Quotas", []):
            if item.get("QuotaName") and item.get("Value") is not None:
                found[item["QuotaName"]] = Quota(item["QuotaName"], item.get("QuotaCode"), float(item["Value"]))
        token = page.get("NextToken")
        if not token:
            return found


def check_instance_quota(quotas: Mapping[str, Quota], instance_type: str, replicas: int, *, spot: bool,
                         region: str) -> None:
    """``ConfigError`` (exit 2) when ``replicas`` single-instance jobs of ``instance_type`` exceed the account's
    quota for it; nothing when they fit or the quota is not listed (SageMaker then decides)."""
    name = quota_name(instance_type, spot=spot)
    quota = quotas.get(name)
    if quota is None or replicas <= quota.value:
        return
    limit = int(quota.value)
    code = f" ({quota.code})" if quota.code else ""
    fewer = f"launch at most {limit} replica(s) of this type (--replicas)" if limit else \
        "pick another --instance-type / --gpu"
    raise ConfigError(
        f"--replicas: {replicas} replicas need {replicas} {instance_type} instances at once, over the account's "
        f"quota '{name}'{code} of {limit} in {region}; SageMaker would refuse job {limit + 1} and nothing was created",
        hint=f"request an increase of '{name}' in Service Quotas > Amazon SageMaker, or {fewer}; jobs already "
             "running on that type count against it too")

"""What SageMaker bills: the instance price (AWS Price List API, else a small dated table) times billable seconds, always labelled an estimate."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from diloco.executors.base import PlanCost
from diloco.executors.sagemaker.config import PRICE_TABLE_DATE, PRICE_TABLE_USD_PER_HOUR


# ---------------------------------------------------------------------------------------------- cost
@functools.cache
def price_per_hour(instance_type: str, region: str) -> tuple[float | None, str]:
    """(USD per instance-hour, where it came from): the AWS Price List API when reachable, else the shipped
    table (labelled with its date). Both are estimates: the bill is the authority. Asked once per process.

    With ``AWS_ENDPOINT_URL`` pointing elsewhere (MinIO, an emulator) and no ``AWS_ENDPOINT_URL_PRICING``, the
    Price List API is not reachable by definition and is not asked."""
    price = None
    if not os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_PRICING"):
        try:
            price = _price_list_api(instance_type, region)
        except Exception:  # noqa: BLE001 - any failure means "not reachable": fall back to the table
            price = None
    if price is not None:
        return price, f"AWS Price List API ({region})"
    table = PRICE_TABLE_USD_PER_HOUR.get(instance_type)
    return table, f"diloco's price table of {PRICE_TABLE_DATE} (us-east-1)" if table is not None else "unknown"


def _price_list_api(instance_type: str, region: str) -> float | None:
    import boto3
    from botocore.config import Config

    client = boto3.client("pricing", region_name="us-east-1",
                          config=Config(connect_timeout=2, read_timeout=4,
                                        retries={"total_max_attempts": 1, "mode": "standard"}))
    filters = [{"Type": "TERM_MATCH", "Field": "instanceName", "Value": instance_type},
               {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region}]
    for raw in client.get_products(ServiceCode="AmazonSageMaker", Filters=filters, MaxResults=20)["PriceList"]:
        product = json.loads(raw) if isinstance(raw, str) else raw
        usage = str(product.get("product", {}).get("attributes", {}).get("usagetype", ""))
        if "Train" not in usage or "Spot" in usage:
            continue
        for term in product.get("terms", {}).get("OnDemand", {}).values():
            for dimension in term.get("priceDimensions", {}).values():
                usd = float(dimension.get("pricePerUnit", {}).get("USD", 0))
                if usd > 0:
                    return usd
    return None


#: What SageMaker bills per job beyond the replica's own work, assumed for estimates made before a launch. A job is
#: billed from TrainingStartTime to TrainingEndTime, and TrainingStartTime comes before the training image is
#: pulled (the API reference: the start seen in CloudWatch "might be later ... due to the time it takes to download
#: the training data and to the size of the training container"); launching the instance before it is not billed.
#: Pulling AWS's PyTorch training image (several GB) and starting the container: about 3 minutes on an ml.m5.xlarge.
IMAGE_START_S = 180.0
#: The no-image bootstrap (pip installing the shipped wheel and whatever requirement the image lacks, such as
#: s3fs): about a minute. A ready image (``--image``) skips it.
BOOTSTRAP_S = 60.0


def estimate_cost_usd(instance_type: str, billable_s: float, region: str) -> tuple[float | None, str]:
    """Estimated cost of ``billable_s`` seconds of one instance: ``(usd, source)``; ``usd`` None if unknown."""
    hourly, source = price_per_hour(instance_type, region)
    return (None if hourly is None else round(hourly * billable_s / 3600.0, 6)), source




def plan_cost(requests: Sequence[Mapping[str, Any]], region: str) -> PlanCost:
    """What the planned jobs cost per hour together (each one instance) and at their time limit
    (``MaxRuntimeInSeconds``), at on-demand prices: managed spot bills less, so with spot both are ceilings."""
    counts: dict[str, int] = {}
    for request in requests:
        instance_type = request["ResourceConfig"]["InstanceType"]
        counts[instance_type] = counts.get(instance_type, 0) + 1
    prices = {t: price_per_hour(t, region) for t in counts}
    limits = [float(r["StoppingCondition"]["MaxRuntimeInSeconds"]) for r in requests]
    spot = any(r.get("EnableManagedSpotTraining") for r in requests)
    unknown = [t for t, (hourly, _) in prices.items() if hourly is None]
    source = "; ".join(dict.fromkeys(source for hourly, source in prices.values() if hourly is not None))
    jobs = ", ".join(f"{n} x {t}" + (f" at ${prices[t][0]:g}/h" if prices[t][0] is not None else "")
                     for t, n in counts.items())
    limit = max(limits) if limits else None
    shown_limit = f"{limit:.0f} s" if len(set(limits)) <= 1 else "each job's MaxRuntimeInSeconds"
    if unknown:
        detail = (f"{jobs}: diloco knows no price for {', '.join(unknown)} in {region} (see the SageMaker pricing "
                  "page); every job may run until its time limit")
        return PlanCost(usd_per_hour=None, usd_at_time_limit=None, time_limit_s=limit, source=source or "unknown",
                        spot_upper_bound=spot, detail=detail)
    per_hour = sum(n * (prices[t][0] or 0.0) for t, n in counts.items())
    at_limit = sum((prices[r["ResourceConfig"]["InstanceType"]][0] or 0.0) * s / 3600.0
                   for r, s in zip(requests, limits, strict=True))
    detail = (f"{jobs}: ${per_hour:,.2f} per hour, ${at_limit:,.2f} if every job runs to its time limit "
              f"({shown_limit}); on-demand prices from {source}, an estimate")
    if spot:
        detail += "; managed spot bills less, so these are upper bounds"
    return PlanCost(usd_per_hour=round(per_hour, 6), usd_at_time_limit=round(at_limit, 6), time_limit_s=limit,
                    source=source, spot_upper_bound=spot, detail=detail)

"""S3 specifics for the object store (filled in by the S3 issue): storage options from the standard AWS settings."""

from __future__ import annotations

from typing import Any


def s3_storage_options() -> dict[str, Any]:
    """s3fs options; the standard AWS environment (profile, region, AWS_ENDPOINT_URL) is honoured by botocore."""
    return {}

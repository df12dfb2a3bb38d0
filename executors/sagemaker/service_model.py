"""botocore's SageMaker service model and endpoint data, read once per process.

The plan checks a request against the model offline (the role ARN pattern, the instance types, every field's
limits) and the regions against botocore's endpoint data; the submit then creates SageMaker clients, which load the
same model. One session serves the lookups and, when the process has no default boto3 session yet, becomes the
default one's, so ``boto3.client(...)`` makes its clients from it; it decodes botocore's data with the process's
one loader (``diloco.store.aws_data``), which the store's S3 filesystems and the doctor's sessions share.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def botocore_session() -> Any:
    """The process's botocore session for offline lookups (boto3's default session's when this made it)."""
    import boto3

    from diloco.store import aws_data

    session = aws_data.botocore_session()
    if boto3.DEFAULT_SESSION is None:
        boto3.setup_default_session(botocore_session=session)
    return session


@functools.cache
def sagemaker_model() -> Any:
    """botocore's SageMaker service model (``botocore.model.ServiceModel``)."""
    return botocore_session().get_service_model("sagemaker")

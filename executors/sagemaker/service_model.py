"""botocore's SageMaker service model and endpoint data, read once per process.

The plan checks a request against the model offline (the role ARN pattern, the instance types, every field's
limits) and the regions against botocore's endpoint data; the submit then creates SageMaker clients, which load the
same model. Each ``botocore.session.get_session()`` is a new session with its own loader, so a launch read the
SageMaker model (over a megabyte of JSON) three times. Here one session serves the lookups and, when the process
has no default boto3 session yet, becomes the default one's, so ``boto3.client(...)`` shares its loader too.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def botocore_session() -> Any:
    """The process's botocore session for offline lookups (boto3's default session's when this made it)."""
    import boto3
    import botocore.session

    session = botocore.session.get_session()
    if boto3.DEFAULT_SESSION is None:
        boto3.setup_default_session(botocore_session=session)
    return session


@functools.cache
def sagemaker_model() -> Any:
    """botocore's SageMaker service model (``botocore.model.ServiceModel``)."""
    return botocore_session().get_service_model("sagemaker")

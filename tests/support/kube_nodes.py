"""What the Kubernetes emulator's nodes give their pods in the end-to-end tests: the AWS settings of the test's moto
(as IRSA-credentialed pods reach S3), the tests directory on ``PYTHONPATH`` (the pods import the tests' trainers)
and one OpenMP thread per replica process."""

from __future__ import annotations

import os

#: The AWS variables a pod inherits from the test (those set).
AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
            "AWS_ENDPOINT_URL", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_EC2_METADATA_DISABLED")


def node_env(tests_dir: str) -> dict[str, str]:
    """The environment the emulator's nodes give every pod."""
    env = {key: os.environ[key] for key in AWS_KEYS if key in os.environ}
    env["PYTHONPATH"] = tests_dir
    env["OMP_NUM_THREADS"] = "1"
    return env

"""The AWS region the launcher works in, resolved the way the AWS CLI resolves it, and where it came from.

Why this exists: botocore reads the region from ``AWS_DEFAULT_REGION`` and the config file only (its
configprovider maps the ``region`` setting to that one variable; boto/boto3#3620 asks for ``AWS_REGION`` and was
closed without it), while the AWS CLI and the other SDKs honour ``AWS_REGION`` first. A user who exports
``AWS_REGION`` alone, as most AWS guides say, would get "no region" from boto3. So diloco resolves it itself, in
the AWS CLI's order, and passes it to every client explicitly:

1. ``--region`` / the config's ``backend.region``;
2. ``AWS_REGION``;
3. ``AWS_DEFAULT_REGION``;
4. the profile's ``region`` in the AWS config file (``AWS_PROFILE``, else ``default``), as boto3 reads it.

Jobs get the resolved region as ``AWS_DEFAULT_REGION`` (what boto3 inside them reads). boto3 is imported only when
the profile has to be consulted.
"""

from __future__ import annotations

import os

#: Every way to set a region, for error hints (each one works with diloco).
REGION_HINT = ("pass --region <region>, or set AWS_REGION (or AWS_DEFAULT_REGION), or `aws configure set region "
               "<region>` for your profile")
#: How the first source is named when it is the one that decided.
EXPLICIT = "--region / backend.region"


def resolve_region(explicit: str | None = None) -> tuple[str | None, str | None]:
    """``(region, where it came from)``; ``(None, None)`` when no source names one. A profile that does not exist
    raises botocore's ``ProfileNotFound``, as any AWS call would."""
    if explicit:
        return explicit, EXPLICIT
    for variable in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        value = os.environ.get(variable, "").strip()
        if value:
            return value, variable
    import boto3

    session = boto3.session.Session()
    if not session.region_name:  # the variables are unset, so botocore found it in the config file, if anywhere
        return None, None
    config_file = os.path.expanduser(os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config")  # botocore's default
    return session.region_name, f"profile {session.profile_name!r} in {config_file}"

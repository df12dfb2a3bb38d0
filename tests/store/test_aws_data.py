"""One process decodes botocore's data once: the store's S3 filesystems, the doctor's sessions and the SageMaker
backend's clients all make their sessions on one loader, and each still talks to its own endpoint with its own
settings. Against moto's real S3 on loopback, through real s3fs and boto3."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.faultproxy import FaultProxy

from diloco.executors.checks import DoctorContext
from diloco.store import aws_data
from diloco.store.objects import ObjectStore


def loader_of(session: object) -> object:
    return session.get_component("data_loader")  # type: ignore[attr-defined]


def test_stores_on_two_endpoints_share_one_loader_and_each_reaches_its_own(s3_uri: str, aws_env: str) -> None:
    direct = ObjectStore(s3_uri, storage_options={"endpoint_url": aws_env})
    direct.put("direct", b"1")
    with FaultProxy(aws_env, seed=7) as proxy:
        proxied = ObjectStore(s3_uri, storage_options={"endpoint_url": proxy.url})
        proxied.put("proxied", b"2")
        assert proxied.get("direct") == b"1"
        assert proxy.count(method="PUT") == 1  # the second store's requests went to its own endpoint
    assert direct.get("proxied") == b"2"
    assert direct.fs is not proxied.fs
    assert loader_of(direct.fs.session) is loader_of(proxied.fs.session)


def test_a_profile_in_the_storage_options_still_reaches_the_session(s3_uri: str, aws_env: str, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "aws-config"
    config.write_text("[profile diloco-test]\nregion = us-east-1\naws_access_key_id = from-profile\n"
                      "aws_secret_access_key = from-profile\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    with FaultProxy(aws_env, seed=7) as proxy:
        store = ObjectStore(s3_uri, storage_options={"profile": "diloco-test", "endpoint_url": proxy.url})
        store.put("k", b"v")
        assert store.get("k") == b"v"
        signed = [seen.headers.get("authorization", seen.headers.get("Authorization", "")) for seen in proxy.seen]
    assert signed and all("Credential=from-profile/" in header for header in signed), signed
    assert store.fs.session.profile == "diloco-test"
    assert loader_of(store.fs.session) is loader_of(aws_data.botocore_session())


def test_the_doctor_and_the_store_share_the_loader_and_another_data_path_gets_its_own(
        s3_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ObjectStore(s3_uri)
    store.put("k", b"v")
    ctx = DoctorContext.for_backend("sagemaker", s3_uri)
    doctor_session = ctx.session()._session  # boto3.Session's botocore session
    assert loader_of(doctor_session) is loader_of(store.fs.session)
    assert ctx.client("s3").head_bucket(Bucket=s3_uri[len("s3://"):].split("/")[0])["ResponseMetadata"][
        "HTTPStatusCode"] == 200

    monkeypatch.setenv("AWS_DATA_PATH", str(tmp_path / "models"))
    elsewhere = aws_data.botocore_session()
    assert loader_of(elsewhere) is not loader_of(store.fs.session)
    assert str(tmp_path / "models") in loader_of(elsewhere).search_paths

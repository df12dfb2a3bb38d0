"""The fault-injecting proxy's own promise: once stopped, nothing more of a test reaches the shared server.

moto's server lives for a whole pytest worker and is reset between tests; a request a proxy was still delaying
when its test ended would otherwise land after the next test's reset, as an object that test never wrote.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from support.faultproxy import FaultProxy
from support.polling import wait_for


def test_a_request_delayed_past_the_proxys_stop_never_reaches_the_server(
        aws_env: str, s3_bucket: str, bucket_keys: Callable[[str], list[str]]) -> None:
    import boto3
    from botocore.config import Config

    outcome: list[BaseException | None] = []
    with FaultProxy(aws_env) as proxy:
        delayed = proxy.add("delay", method="PUT", path=r"/late$", delay_s=600.0)
        client = boto3.client("s3", endpoint_url=proxy.url,
                              config=Config(retries={"max_attempts": 1}, read_timeout=600))

        def put() -> None:
            try:
                client.put_object(Bucket=s3_bucket, Key="late", Body=b"x")
                outcome.append(None)
            except Exception as exc:  # noqa: BLE001 - the hang-up is the expected outcome
                outcome.append(exc)

        writer = threading.Thread(target=put, daemon=True)
        writer.start()
        wait_for(lambda: delayed.fired == 1, "the PUT to be held by the delay rule")
    writer.join(timeout=60)
    assert not writer.is_alive(), "the held PUT is still waiting: stopping the proxy did not release it"
    assert outcome[0] is not None, "the held PUT was answered, so it was forwarded"
    assert bucket_keys(s3_bucket) == []

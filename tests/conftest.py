"""A real S3 API on loopback for the S3 tests: moto's standalone server, driven through real boto3/s3fs.

Nothing is patched: code under test finds the server the way it finds any S3-compatible store, through
``AWS_ENDPOINT_URL``, which subprocesses (replicas) inherit. Credentials are moto's fake ones; the user's AWS
config and credential files are hidden so a developer's real profile can never be picked up.

Fixtures (opt-in, except the two autouse ones at the end: an empty memory:// and no inherited terminal size):

* ``emulator``: the SageMaker API emulator (tests/emulators/sagemaker.py) on that moto, endpoint exported.
* ``home``: a fresh ``DILOCO_HOME`` for the test (set in the environment).
* ``moto_server`` (session): the server's base URL.
* ``aws_env``: resets moto (``POST /moto-api/reset``) and points the AWS environment at it.
* ``s3_bucket``: a fresh bucket on the clean server; ``s3_uri`` a unique prefix in it.
* ``fault_proxy``: a ``FaultProxy`` in front of moto, with ``AWS_ENDPOINT_URL`` pointing at the proxy.
* ``bucket_keys``: list a bucket straight from moto.
* ``managed_policies``: moto with AWS's managed IAM policies loaded (it resets moto: request it first).

Order: the long scenarios go out early and spread among the short tests, by ``tests/test_durations.json``
(``support.run_order``), so that under pytest-xdist no worker finishes alone on a long test at the end.
"""

from __future__ import annotations

import os
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.memory import MemoryFileSystem

# The shared helpers assert too: rewrite them as pytest rewrites test modules, before the first import of them.
pytest.register_assert_rewrite("support")

from support import STARTUP_DIR  # noqa: E402
from support.faultproxy import FaultProxy  # noqa: E402 (tests/ is on sys.path: pytest's rootdir-relative import)
from support.process_census import ProcessCensus  # noqa: E402
from support.run_order import DurationRecorder, dispatch_order, load_durations  # noqa: E402
from support.time_budget import TimeBudgets  # noqa: E402

BUCKET = "diloco-test-bucket"
REGION = "us-east-1"

#: Variables that could route a test to a real account or change retry behaviour behind the test's back.
_CLEARED = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_STS", "AWS_ENDPOINT_URL_IAM",
    "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "DILOCO_S3_URI",
)


def pytest_configure(config: pytest.Config) -> None:
    """Each test file is held to its time budget (``support.time_budget``), and the real replica processes the
    tests start are counted by backend (``support.process_census``).

    Ctrl-C tests send SIGINT to the CLI and expect Python's KeyboardInterrupt there. A shell that starts the
    suite in the background (``make test &``, ``nohup``) leaves SIGINT ignored, and an ignored signal stays ignored
    across exec in every process started from here; give it back its default so the tests see what a user's
    terminal gives."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _start_processes_without_the_compiler()
    config.pluginmanager.register(TimeBudgets(), "diloco-time-budgets")
    config.pluginmanager.register(ProcessCensus(), "diloco-process-census")
    config.pluginmanager.register(DurationRecorder(), "diloco-test-durations")


def _start_processes_without_the_compiler() -> None:
    """Every process the suite starts (pytest's workers, replicas, CLI invocations) gets ``tests/startup`` first on
    its ``PYTHONPATH``, unless a test hands it an environment of its own: about 1.3 CPU-seconds saved in each
    replica that builds a torch optimizer (``tests/startup/compiler_on_demand.py`` says how, and why it changes no
    behaviour)."""
    entries = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if str(STARTUP_DIR) not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(STARTUP_DIR), *entries])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadgroup``, a module marked ``xdist_group`` goes to one worker whole
    (``support.xdist_groups``: what xdist's own grouping no longer does on this pytest)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from support.xdist_groups import ModuleGroupScheduling

    return ModuleGroupScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long scenarios early and spread among the short tests, by what each test took in the last whole run
    (``support.run_order``): under pytest-xdist no worker finishes alone on a long one, and the short tests' waits
    are filled all along."""
    dispatch_order(items, load_durations())


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh DILOCO_HOME (run registry and local runs) for this test, set in the environment."""
    path = tmp_path / "home"
    monkeypatch.setenv("DILOCO_HOME", str(path))
    return path


@pytest.fixture(scope="session")
def bootstrap_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory the emulated jobs' bootstrap keeps installed packages in for the whole session (a warm
    instance's persistent cache): the install of one wheel is paid once, not by every job. The tests about the
    install itself (tests/backends/sagemaker/test_sagemaker_bootstrap.py, test_sagemaker_image.py, the
    Kubernetes code channel) run without it, and a job whose pip settings differ gets a site of its own."""
    return tmp_path_factory.mktemp("bootstrap-cache")


@pytest.fixture
def emulator(aws_env: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             bootstrap_cache: Path) -> Iterator[Any]:
    """The SageMaker emulator on the test's clean moto, as the CLI meets it: a subprocess finds it through
    ``AWS_ENDPOINT_URL_SAGEMAKER`` (tests/test_emulator_sagemaker.py overrides it with its own settings)."""
    from emulators.sagemaker import SageMakerEmulator

    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", stop_grace_s=2.0,
                           log_flush_s=0.1, restart_delay_s=0.2, bootstrap_cache=bootstrap_cache) as emu:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", emu.url)
        yield emu


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """moto's S3/STS/IAM/Logs/ECR server on a free loopback port, for the whole session."""
    from emulators.moto_server import start_moto_server

    server = start_moto_server()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def reset_moto(url: str) -> None:
    """Forget every bucket, object, role and log group (moto's documented reset endpoint)."""
    req = urllib.request.Request(f"{url}/moto-api/reset", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


@pytest.fixture
def aws_env(moto_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A clean moto and an AWS environment that reaches it (inherited by subprocesses); returns the URL."""
    reset_moto(moto_server)
    for name in _CLEARED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return moto_server


@pytest.fixture
def s3_bucket(aws_env: str) -> str:
    """A fresh, empty bucket (created directly on moto, never through a fault proxy)."""
    import boto3

    boto3.client("s3", endpoint_url=aws_env).create_bucket(Bucket=BUCKET)
    return BUCKET


@pytest.fixture
def s3_uri(s3_bucket: str) -> str:
    """A unique ``s3://bucket/prefix`` for one test."""
    return f"s3://{s3_bucket}/t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def fault_proxy(aws_env: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of moto; every S3 client created afterwards goes through it."""
    with FaultProxy(aws_env, seed=1234) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        yield proxy


@pytest.fixture
def bucket_keys(aws_env: str) -> Callable[[str], list[str]]:
    """``bucket_keys(bucket)``: every key in the bucket, straight from moto (to prove clean-up)."""

    def keys(bucket: str) -> list[str]:
        import boto3

        s3 = boto3.client("s3", endpoint_url=aws_env)
        found: list[str] = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            found += [obj["Key"] for obj in page.get("Contents", [])]
        return found

    return keys


@pytest.fixture
def managed_policies(aws_env: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """moto with AWS's managed IAM policies (AmazonSageMakerFullAccess...), which it ships but loads only when
    MOTO_IAM_LOAD_MANAGED_POLICIES is set as its IAM backend is built. The server runs in this process, so the
    variable plus a reset configures it. Request this fixture before ``s3_bucket``: it resets moto."""
    monkeypatch.setenv("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")
    reset_moto(aws_env)
    return aws_env


@pytest.fixture(autouse=True)
def _no_inherited_terminal_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI honours ``COLUMNS``/``LINES`` (a user's narrow terminal); pytest-xdist workers inherit 80x24 in
    them, so tests start without them and the ones about narrow terminals set them."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)


@pytest.fixture(autouse=True)
def _clean_memory_fs() -> Iterator[None]:
    """memory:// is one process-global dict: every test starts and ends with it empty."""
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]
    yield
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]

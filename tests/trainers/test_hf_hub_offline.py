"""The Hugging Face trainer without a reachable Hub, through the CLI as a user types it.

A ``-k tokenizer=`` or ``-k model=`` that is not a local directory is a Hub name: when the Hub cannot be reached
(connection refused, a Hub that never answers, or ``HF_HUB_OFFLINE=1``) and the Hugging Face cache has no copy,
``diloco launch`` fails within seconds, before any replica starts, with one line naming the field and the fix (a
local directory; README shows how to build a tokenizer offline), exit 2. A replica started by hand does the same
check itself. A copy in the cache is used without the Hub. README's recipe for a tokenizer built offline gives a
directory the launch accepts.

Every Hub here is on loopback (``HF_ENDPOINT``), and ``HF_HOME`` is the test's own, so what the machine's network
or cache holds changes nothing.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from readme_blocks import block_starting
from support.commands import DILOCO_SCRIPT as DILOCO

#: One worker runs this module: its module-scoped run (or server) is then started once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_hf_hub_offline")

#: A launch that fails before starting anything takes a CLI start and one bounded Hub probe; an unfixed launch
#: starts replicas that retry the Hub for over a minute. Past this the test fails (and cleans up) instead of
#: waiting for them.
FAIL_FAST_S = 45
#: Bound on a command that does its work (build a tokenizer, load one, a dry run): only against a hang.
GUARD_S = 240
HF_SECTION = "Bring your Hugging Face model"


@pytest.fixture
def refused_endpoint() -> str:
    """A loopback URL nothing listens on: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A loopback URL that accepts connections and never answers (a black-holed proxy, a hung Hub)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus"
    path.mkdir()
    (path / "a.txt").write_text("the cat sees the moon. " * 200)
    return path


def hf_env(tmp_path: Path, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "DILOCO_DEBUG"))}
    return {**env, "DILOCO_HOME": str(home), "HF_HOME": str(tmp_path / "hf-home"), "NO_COLOR": "1", **extra}


def run_bounded(argv: list[str], *, env: dict[str, str], cwd: Path,
                limit_s: float = FAIL_FAST_S) -> subprocess.CompletedProcess[str]:
    """``argv`` in its own process group, failing the test past ``limit_s`` (after killing the group and
    cancelling whatever run it started)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        subprocess.run([DILOCO, "cancel"], env=env, cwd=cwd, capture_output=True, timeout=120)
        pytest.fail(f"{' '.join(argv[:3])} did not end within {limit_s:g} s without a reachable Hub")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def hf_launch(*kwargs: str, dry_run: bool = False) -> list[str]:
    args = [DILOCO, "launch", "-n", "2", "-b", "local", "--trainer", "diloco.trainers.hf:train", "--steps", "2",
            "--sync-every", "1", "-k", "model_config={model_type: llama, hidden_size: 32, intermediate_size: 64, "
            "num_hidden_layers: 1, num_attention_heads: 2}", "-k", "block_size=16"]
    for kwarg in kwargs:
        args += ["-k", kwarg]
    return [*args, *(["--dry-run"] if dry_run else [])]


def assert_refused_in_one_line(result: subprocess.CompletedProcess[str], field: str, name: str, home: Path) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith(f"diloco: error: {field}: {name!r} is not a local directory"), line
    assert f"-k {field}=" in line and "save_pretrained" in line, line  # the fix: a local directory
    assert not (home / "runs").exists() or not list((home / "runs").glob("*.json"))  # nothing launched
    return line


@pytest.mark.parametrize("hub", ["refused", "silent", "offline"])
def test_a_hub_tokenizer_without_the_hub_fails_before_launch_in_one_line(
        hub: str, request: pytest.FixtureRequest, home: Path, tmp_path: Path, corpus: Path) -> None:
    extra = ({"HF_HUB_OFFLINE": "1"} if hub == "offline"
             else {"HF_ENDPOINT": request.getfixturevalue(f"{hub}_endpoint")})
    result = run_bounded(hf_launch("tokenizer=gpt2", f"data={corpus}"), env=hf_env(tmp_path, home, **extra),
                         cwd=tmp_path)
    line = assert_refused_in_one_line(result, "tokenizer", "gpt2", home)
    assert ("HF_HUB_OFFLINE=1" if hub == "offline" else "cannot be reached") in line


def test_a_hub_model_without_the_hub_names_the_model_field(
        home: Path, tmp_path: Path, corpus: Path, refused_endpoint: str) -> None:
    argv = [DILOCO, "launch", "-n", "2", "-b", "local", "--trainer", "diloco.trainers.hf:train", "--steps", "2",
            "--sync-every", "1", "-k", "model=Qwen/Qwen2.5-0.5B", "-k", f"data={corpus}"]
    result = run_bounded(argv, env=hf_env(tmp_path, home, HF_ENDPOINT=refused_endpoint), cwd=tmp_path)
    assert_refused_in_one_line(result, "model", "Qwen/Qwen2.5-0.5B", home)


def test_a_replica_started_by_hand_checks_the_hub_itself(tmp_path: Path, home: Path, refused_endpoint: str,
                                                          corpus: Path) -> None:
    """Where the launcher cannot look (a SageMaker or EKS replica), the replica fails the same way, exit 2."""
    kwargs = {"model_config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 1, "num_attention_heads": 2},
              "tokenizer": "gpt2", "data": str(corpus), "total_steps": 2, "sync_every": 1, "block_size": 16}
    argv = [sys.executable, "-m", "diloco.replica.entrypoint", "--rendezvous", f"file://{tmp_path / 'rdv'}",
            "--world-size", "1", "--rank", "0", "--trainer", "diloco.trainers.hf:train",
            "--trainer-kwargs-json", json.dumps(kwargs), "--timeout", "60"]
    result = run_bounded(argv, env=hf_env(tmp_path, home, HF_ENDPOINT=refused_endpoint), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "tokenizer: 'gpt2' is not a local directory" in last and "cannot be reached" in last, last
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------------------- what does work
def readme_recipe() -> tuple[str, list[str]]:
    """README's offline tokenizer file and the commands shown with it (``python make_tokenizer.py``, the launch)."""
    code = block_starting(HF_SECTION, "python", "# make_tokenizer.py: a byte-level BPE tokenizer trained on "
                                                "./corpus/*.txt, saved as ./my-tokenizer")
    commands = block_starting(HF_SECTION, "bash", "python make_tokenizer.py").replace("\\\n", " ")
    return code, [line for line in commands.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def recipe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """README's recipe run as a user would: ``python make_tokenizer.py`` in a folder holding ``corpus/``."""
    folder = tmp_path_factory.mktemp("recipe")
    (folder / "corpus").mkdir()
    for i in range(3):
        (folder / "corpus" / f"doc{i}.txt").write_text(f"document {i}: the cat sees the moon and a red box. " * 50)
    code, commands = readme_recipe()
    (folder / "make_tokenizer.py").write_text(code)
    assert commands[0] == "python make_tokenizer.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    made = subprocess.run([sys.executable, "make_tokenizer.py"], cwd=folder, capture_output=True, text=True,
                          timeout=GUARD_S, env={**env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(folder / "hf-home")})
    assert made.returncode == 0, made.stderr
    return folder


def test_readmes_offline_tokenizer_loads_and_readmes_launch_accepts_it(
        recipe_folder: Path, home: Path, tmp_path: Path, refused_endpoint: str) -> None:
    """The directory loads with ``AutoTokenizer`` and has the EOS that separates documents; README's launch
    command, from that folder with no Hub, passes every check (``--dry-run``: nothing is trained)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(recipe_folder / "my-tokenizer")
    assert tok.eos_token == "<eos>" and tok("the cat sees the moon")["input_ids"]
    launch = shlex.split(readme_recipe()[1][1])
    assert launch[:2] == ["diloco", "launch"] and "tokenizer=./my-tokenizer" in launch
    result = run_bounded([DILOCO, *launch[1:], "--dry-run"], env=hf_env(tmp_path, home, HF_ENDPOINT=refused_endpoint),
                         cwd=recipe_folder, limit_s=GUARD_S)
    assert result.returncode == 0, result.stderr


def cache_copy(hf_home: Path, repo_id: str, directory: Path) -> None:
    """``directory``'s files as the Hugging Face cache holds a download of ``repo_id``: ``hub/models--ORG--NAME``
    with ``refs/main`` naming a snapshot, and the files looked for and not found on the Hub (a tokenizer-only repo
    has no ``config.json``) under ``.no_exist/``."""
    revision = "0" * 40
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(directory, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    (repo / ".no_exist" / revision).mkdir(parents=True)
    (repo / ".no_exist" / revision / "config.json").touch()


@pytest.mark.parametrize("hub", ["refused", "offline"])
def test_a_cached_hub_tokenizer_needs_no_hub(hub: str, request: pytest.FixtureRequest, recipe_folder: Path,
                                            home: Path, tmp_path: Path, corpus: Path) -> None:
    """In the cache, a Hub name passes the launch's check and a replica loads it without the Hub."""
    from transformers import AutoTokenizer

    readme_tokenizer = recipe_folder / "my-tokenizer"
    cache_copy(tmp_path / "hf-home", "someone/tok", readme_tokenizer)
    extra = ({"HF_HUB_OFFLINE": "1"} if hub == "offline"
             else {"HF_ENDPOINT": request.getfixturevalue(f"{hub}_endpoint")})
    env = hf_env(tmp_path, home, **extra)
    checked = run_bounded(hf_launch("tokenizer=someone/tok", f"data={corpus}", dry_run=True), env=env, cwd=tmp_path,
                          limit_s=GUARD_S)
    assert checked.returncode == 0, checked.stderr
    # What a replica does: ask where the tokenizer can come from (the Hub probe, once), then load it from there.
    code = ("from diloco.trainers import hf; "
            "only = hf.check_hub_sources(model=None, tokenizer='someone/tok')['tokenizer']; "
            "print(len(hf.load_tokenizer('someone/tok', cache_only=only)))")
    loaded = run_bounded([sys.executable, "-c", code], env=env, cwd=tmp_path, limit_s=GUARD_S)
    assert loaded.returncode == 0, loaded.stderr
    assert int(loaded.stdout) == len(AutoTokenizer.from_pretrained(readme_tokenizer))

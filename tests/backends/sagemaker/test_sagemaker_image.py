"""Jobs on AWS's prebuilt PyTorch training image, run by the emulator in an interpreter that holds only that image's
packages (tests/emulators/sagemaker_image.py: the default 2.10 image's, no transformers, tokenizers or tensorboard,
and a botocore forced above what its aiobotocore requires), with the bootstrap's pip installing for real from a
local wheelhouse.

* The emulated image is what its Dockerfile makes it (the packages the proofs below depend on), the conflict pip
  warns about when the Dockerfile forces botocore included.
* A job's store works on a consistent set although the image meets every top-level requirement of the store by
  name and version: the bootstrap sees aiobotocore's botocore pin broken, says so, and installs a consistent
  aiobotocore and botocore into its own directory; the image is left untouched.
* ``configs/hf-qwen.yaml`` with a tiny model config and local data trains 2 replicas, and the collected directory
  loads with ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from emulators import sagemaker_image
from emulators.sagemaker import SageMakerEmulator
from support.commands import run_cli as cli
from support.sagemaker_jobs import log_lines, role

#: The first session on a machine builds the image-like interpreter and the wheelhouse (minutes, once; cached).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[3]
#: Each job's bootstrap really installs packages with pip, and imports transformers: a launch takes minutes when
#: the machine is busy, so its CLI call gets more than the shared default.
IMAGE_LAUNCH_TIMEOUT_S = 420


# ---------------------------------------------------------------------------------------------------- fixtures
def extras_requirements(*extras: str) -> list[str]:
    """diloco's own requirement strings for ``extras`` (its installed metadata: what the shipped wheel declares)."""
    import importlib.metadata

    out = []
    for line in importlib.metadata.requires("diloco") or []:
        requirement, _, marker = line.partition(";")
        if any(f'extra == "{e}"' in marker or f"extra == '{e}'" in marker for e in extras):
            out.append(requirement.strip())
    return out


@pytest.fixture(scope="session")
def image_python() -> Path:
    return sagemaker_image.image_python()


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    """Wheels for everything the store and the Hugging Face trainer need (the jobs' stand-in package index), and
    boto3: the bootstrap upgrades the image's boto3 along with the botocore a new s3fs needs."""
    return sagemaker_image.wheelhouse([*extras_requirements("aws", "hf"), "boto3"])


@pytest.fixture
def image_emulator(aws_env: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   image_python: Path, wheelhouse: Path) -> Iterator[SageMakerEmulator]:
    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", stop_grace_s=2.0,
                           log_flush_s=0.1, restart_delay_s=0.2, prebuilt_python=image_python,
                           pip_wheelhouse=wheelhouse) as emu:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", emu.url)
        yield emu


@pytest.fixture
def image_site(image_python: Path) -> Iterator[Path]:
    """The image's site-packages; the test fails if anything in it changed (a job must never write there)."""
    site = sagemaker_image.site_packages(image_python)
    before = snapshot(site)
    yield site
    assert snapshot(site) == before, "a job modified the image's own site-packages"


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(directory).as_posix(): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in directory.iterdir()}


def run_in(python: Path, code: str) -> subprocess.CompletedProcess[str]:
    """``python -c code`` as a container would run it: outside the checkout (``-c`` puts the working directory on
    ``sys.path``, and a checkout may hold an editable install's ``diloco.egg-info``)."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/"), **sagemaker_image.DLC_IMAGE_ENV}
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          cwd=Path(python).anchor)


# ---------------------------------------------------------------------------------------------------- the image
def test_the_emulated_image_holds_the_images_packages_and_none_of_the_extras(image_python: Path) -> None:
    probe = run_in(image_python, """
import importlib.metadata as m, importlib.util, json, sys
names = ["transformers", "tokenizers", "tensorboard", "diloco", "torch", "s3fs", "boto3", "botocore",
         "aiobotocore", "numpy", "pyarrow", "safetensors", "huggingface-hub"]
found = {}
for n in names:
    try:
        found[n] = m.version(n)
    except m.PackageNotFoundError:
        found[n] = None
print(json.dumps({"versions": found, "prefix": sys.prefix, "base": sys.base_prefix,
                  "torch_imports": importlib.util.find_spec("torch") is not None}))
""")
    assert probe.returncode == 0, probe.stderr
    info = json.loads(probe.stdout)
    versions = info["versions"]
    assert versions["transformers"] is None and versions["tokenizers"] is None and versions["tensorboard"] is None
    assert versions["diloco"] is None  # only the bootstrap brings diloco
    # s3fs>=2026.2.0 with the aiobotocore it pulled, then boto3/botocore forced to >=1.43.34 over that aiobotocore
    assert (versions["s3fs"], versions["aiobotocore"]) == ("2026.7.0", "3.7.0")
    assert (versions["boto3"], versions["botocore"]) == ("1.43.34", "1.43.34")
    assert versions["numpy"] == "2.3.5" and versions["pyarrow"] and versions["safetensors"]
    assert info["torch_imports"] and info["prefix"] != info["base"]  # its own environment, not the system's
    check = run_in(image_python, "import runpy, sys; sys.argv = ['pip', 'check']; runpy.run_module('pip', "
                                 "run_name='__main__')")
    assert "aiobotocore 3.7.0 has requirement botocore<1.43.1,>=1.42.90, but you have botocore 1.43.34" in \
        check.stdout, check.stdout + check.stderr  # the conflict the Dockerfile says pip warns about


# ---------------------------------------------------------------------------------------------------- s3fs
STORE_PROBE_TRAINER = '''
import importlib.metadata, json, os

from diloco.store.objects import ObjectStore
from diloco.trainers.gpt import diloco_train


def train(*, manager, rank, world_size, **kwargs):
    """Create one object twice through the run's store (a conditional create), report where s3fs and the AWS
    libraries came from, then train as the built-in trainer."""
    import aiobotocore, boto3, botocore, s3fs

    store = ObjectStore(os.environ["RENDEZVOUS_URI"])
    first = store.put_if_absent(f"probe/rank_{rank}", b"first")
    second = store.put_if_absent(f"probe/rank_{rank}", b"second")
    modules = (s3fs, aiobotocore, boto3, botocore)
    requires = [r for m in ("aiobotocore", "boto3") for r in importlib.metadata.requires(m) or []
                if r.startswith(("botocore", "boto3", "s3transfer")) and "extra ==" not in r]
    print("store probe " + json.dumps({
        "created": [first, second], "kept": store.get(f"probe/rank_{rank}").decode(),
        "versions": {m: importlib.metadata.version(m) for m in ("s3fs", "aiobotocore", "boto3", "botocore",
                                                                "s3transfer")},
        "files": {m.__name__: m.__file__ for m in modules},
        "requires": requires,
    }), flush=True)
    return diloco_train(manager=manager, rank=rank, world_size=world_size, **kwargs)
'''


def test_a_job_on_the_image_writes_to_the_store_with_the_s3fs_diloco_needs(
    image_emulator: SageMakerEmulator, image_site: Path, s3_bucket: str, home: Path, tmp_path: Path
) -> None:
    from packaging.requirements import Requirement
    from packaging.version import Version

    source = tmp_path / "src"
    source.mkdir()
    (source / "storeprobe.py").write_text(STORE_PROBE_TRAINER)
    launch = cli("launch", "--backend", "sagemaker", "--role", role(image_emulator), "--region", "us-east-1",
                 "--rendezvous", f"s3://{s3_bucket}/img/{{run_id}}", "--source-dir", str(source),
                 "--set", "store.poll_interval_s=0.2", "--replicas", "1", "--trainer", "storeprobe:train",
                 "--steps", "4", "--sync-every", "2", "-k", "n_layer=1", "-k", "n_embd=16", "-k", "eval_batches=1",
                 "-k", "threads=1", "-o", "json", home=home, cwd=tmp_path, timeout=IMAGE_LAUNCH_TIMEOUT_S)
    run_id = json.loads(launch.stdout)["run_id"] if launch.stdout.strip() else None
    lines = log_lines(f"{run_id}-r0") if run_id else []
    assert launch.returncode == 0, "\n".join(lines[-40:]) or launch.stderr[-3000:]
    probe = json.loads(next(line for line in lines if line.startswith("store probe "))[len("store probe "):])
    assert probe["created"] == [True, False] and probe["kept"] == "first"
    assert Version(probe["versions"]["s3fs"]) >= Version("2025.7.0")
    site = Path(image_emulator.job(f"{run_id}-r0").opt_ml or "") / "diloco" / "site"
    bootstrap = [line for line in lines if line.startswith("diloco bootstrap")]
    repair = next((line for line in bootstrap if "are inconsistent" in line), None)
    assert repair is not None, bootstrap  # every top-level name is met: only the closure check asks pip
    assert "s3fs[boto3]>=2025.7.0" in repair and "aiobotocore 3.7.0 requires botocore<1.43.1" in repair, repair
    assert "this image has botocore 1.43.34" in repair, repair
    for module in ("aiobotocore", "botocore"):  # the repaired pair, from the bootstrap's directory
        assert Path(probe["files"][module]).is_relative_to(site), (module, probe["files"], bootstrap)
    assert any(r.startswith("botocore") for r in probe["requires"])  # aiobotocore's and boto3's pins all hold
    for requirement in map(Requirement, probe["requires"]):
        assert requirement.specifier.contains(probe["versions"][requirement.name]), (requirement, probe["versions"])
    installing = next(line for line in lines if line.startswith("diloco bootstrap: installing what this image lacks"))
    assert "botocore==" in installing and "aiobotocore==" in installing, installing
    assert "transformers" not in installing  # the default trainer needs no hf extra


# ---------------------------------------------------------------------------------------------------- Hugging Face
SUBJECTS = ["the cat", "a dog", "the bird", "my friend", "the old man", "a child"]
VERBS = ["sees", "likes", "finds", "follows", "draws", "helps"]
OBJECTS = ["the ball", "a tree", "the river", "some bread", "the moon", "a red box"]
#: A GPT-2 of one layer, width 32: a model config that trains in seconds (and keeps the settings short).
TINY_MODEL = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2}


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}." for _ in range(4))
            for _ in range(n)]


def write_hf_source(source: Path) -> None:
    """The user's source directory: a tokenizer trained here and a JSONL corpus (nothing from a hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences(200, seed=99), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(
        source / "tok")
    (source / "corpus").mkdir(parents=True)
    (source / "corpus" / "part-0.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                                            for d in sentences(160, seed=1)))


def test_the_hf_qwen_config_trains_two_replicas_on_the_image_and_the_result_loads_with_from_pretrained(
    image_emulator: SageMakerEmulator, image_site: Path, s3_bucket: str, home: Path, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    source = tmp_path / "src"
    write_hf_source(source)
    # The config's own settings, but for the model (a tiny config instead of a hub name), the data and tokenizer
    # (shipped in the source directory), the sizes and the precision (this machine has no GPU).
    kwargs = {"model": None, "model_config": TINY_MODEL, "tokenizer": "tok", "data": "corpus", "block_size": 16,
              "batch_size": 4, "warmup_steps": 1, "precision": "fp32"}
    args = ["launch", "--config", str(REPO / "configs" / "hf-qwen.yaml"), "--replicas", "2",
            "--role", role(image_emulator), "--region", "us-east-1",
            "--rendezvous", f"s3://{s3_bucket}/hf/{{run_id}}", "--source-dir", str(source),
            "--procs-per-replica", "1", "--steps", "4", "--sync-every", "2",
            "--set", "store.poll_interval_s=0.2", "-o", "json"]
    for key, value in kwargs.items():
        args += ["-k", f"{key}={json.dumps(value)}"]
    launch = cli(*args, home=home, cwd=tmp_path, timeout=IMAGE_LAUNCH_TIMEOUT_S)
    run_id = json.loads(launch.stdout)["run_id"] if launch.stdout.strip() else None
    lines = {r: log_lines(f"{run_id}-r{r}") if run_id else [] for r in (0, 1)}
    assert launch.returncode == 0, "\n".join(lines[0][-40:]) or launch.stderr[-3000:]
    summary = json.loads(launch.stdout)
    assert summary["state"] == "succeeded" and summary["weights_identical"] is True, summary
    for rank in (0, 1):  # the bootstrap's pip installed the hf extra for real, in each job
        installing = next(line for line in lines[rank] if "installing what this image lacks" in line)
        # the hf extra, and the repaired AWS SDK pair (the image's s3fs is new enough; its botocore set is broken)
        assert all(f"{name}==" in installing for name in ("transformers", "tokenizers", "tensorboard", "botocore"))
        assert "pyarrow" not in installing  # the image's own pyarrow satisfies the extra

    model_file = tmp_path / "model.safetensors"
    collected = cli("collect", run_id, "--output", str(model_file), "-o", "json", home=home, cwd=tmp_path)
    assert collected.returncode == 0, collected.stderr
    report = json.loads(collected.stdout)
    assert report["weights_identical"] is True
    weights = load_file(str(model_file))
    # The directory each job left in $SM_MODEL_DIR (its model.tar.gz) and rank 0's copy in the store both load.
    for directory in (unpack_model_artifact(report["ranks"][1]["artifacts"]["model"], tmp_path / "r1"),
                      download_prefix(f"s3://{s3_bucket}/hf/{run_id}", "hf_model/", tmp_path / "hf_model")):
        loaded = AutoModelForCausalLM.from_pretrained(directory)
        state = loaded.state_dict()
        assert weights and all(torch.equal(state[name], tensor) for name, tensor in weights.items()), directory
        assert loaded.config.model_type == "gpt2" and loaded.config.n_embd == 32


def unpack_model_artifact(uri: str, into: Path) -> Path:
    import io
    import tarfile

    import boto3

    bucket, key = uri[len("s3://"):].split("/", 1)
    blob = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into


def download_prefix(root: str, prefix: str, into: Path) -> Path:
    from diloco.store.objects import ObjectStore

    store = ObjectStore(root)
    for key in store.list(prefix):
        target = into / key[len(prefix):]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(store.get(key))
    return into


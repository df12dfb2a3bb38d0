"""Configuration: precedence, one-line errors naming the field and what is allowed, the shipped YAML files."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.errors import ConfigError
from diloco.executors.kubernetes import KubernetesBackendConfig as EKSBackendConfig
from diloco.executors.local import LocalBackendConfig
from diloco.executors.sagemaker import SageMakerBackendConfig
from diloco.launcher.config import RunConfig, merge_sources, resolve_config, validate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def error_of(**kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_config(**kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    return message


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_are_a_valid_local_run() -> None:
    cfg = resolve_config()
    assert cfg == RunConfig()
    assert isinstance(cfg.backend, LocalBackendConfig)
    assert cfg.train.trainer == "diloco.trainers.gpt:diloco_train"
    assert cfg.store.rendezvous is None


def test_precedence_defaults_yaml_flags_trainer_kwargs_set(tmp_path: Path) -> None:
    path = write(tmp_path, "replicas: 3\ntrain: {steps: 40, sync_every: 10, trainer_kwargs: {lr: 0.1, n_layer: 1}}\n")
    assert resolve_config(path).replicas == 3
    cfg = resolve_config(path, flags={"replicas": 5, "train.steps": None}, trainer_kwargs=["lr=0.5"],
                         sets=["train.steps=80", "train.trainer_kwargs.n_layer=2", "store.timeout_s=30"])
    assert cfg.replicas == 5  # flag beats YAML
    assert cfg.train.steps == 80  # --set beats YAML (and a None flag is "not given")
    assert cfg.train.sync_every == 10  # untouched YAML value stays
    assert cfg.train.trainer_kwargs == {"lr": 0.5, "n_layer": 2}  # values parsed as YAML: float, int
    assert cfg.store.timeout_s == 30.0


def test_backend_flag_switches_kind_and_drops_other_backend_options(tmp_path: Path) -> None:
    path = write(tmp_path, "backend: {kind: local, grace_period_s: 3}\n")
    assert resolve_config(path).backend == LocalBackendConfig(grace_period_s=3)
    data = merge_sources(path, flags={"backend": "eks"})
    assert data["backend"] == {"kind": "eks"}
    assert resolve_config(path, flags={"backend": "local"}).backend.grace_period_s == 3  # same kind: kept
    assert isinstance(validate({"backend": "local"}).backend, LocalBackendConfig)  # shorthand


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"flags": {"replicas": 0}}, "replicas: must be >= 1 (got 0)"),
    ({"flags": {"backend": "ec2"}}, "backend: must be one of local, sagemaker, eks, mixed (got 'ec2')"),
    ({"sets": ["replicas=four"]}, "replicas: must be an integer (got 'four')"),
    ({"sets": ["train.bogus=1"]},
     "train.bogus: unknown key (allowed: trainer, steps, sync_every, eval_every, trainer_kwargs, mode, procs_per_replica)"),
    ({"sets": ["backend.bogus=1"]},
     "backend.bogus: unknown key for the local backend (allowed: log_root, grace_period_s, python"),
    ({"sets": ["store.timeout_s=0"]}, "store.timeout_s: must be > 0 (got 0)"),
    ({"flags": {"train.steps": 30, "train.sync_every": 20}},
     "train.steps: must be a multiple of train.sync_every (20) so the run ends on an outer sync (got 30)"),
    ({"flags": {"train.trainer": "not-a-function"}},
     "train.trainer: must look like 'package.module:function' (got 'not-a-function')"),
    ({"trainer_kwargs": ["total_steps=5"]}, "train.trainer_kwargs.total_steps: not allowed here (set train.steps"),
    ({"flags": {"store.rendezvous": "memory://x"}}, "store.rendezvous: memory:// lives inside one process"),
    ({"flags": {"store.rendezvous": "gs://b/p"}}, "store.rendezvous: scheme must be one of file, s3"),
    ({"sets": ["gpu=A10G"]}, "gpu: the local backend runs on this machine"),
    ({"sets": ["train=5"]}, "train: must be a mapping of keys to values (got 5)"),
    ({"sets": ["nope"]}, "--set: expected key=value (got 'nope')"),
    ({"trainer_kwargs": ["=3"]}, "--trainer-kwargs: expected key=value (got '=3')"),
    ({"flags": {"replicas": 4, "store.min_replicas": 5}},
     "store.min_replicas: must be at most the number of replicas (4) (got 5)"),
    ({"flags": {"store.min_replicas": 2, "store.allreduce": "sharded"}},
     "store.min_replicas: partial participation needs allreduce gather"),
    ({"sets": ["min_replicas=2"]}, "min_replicas: unknown key (allowed: replicas, backend, store, train"),
    ({"flags": {"store.compression": "int9"}}, "store.compression: must be 'none', 'bf16', 'int8', 'int4' or 'topk'"),
    ({"flags": {"store.compression": "topk", "store.allreduce": "sharded"}},
     "store.compression: topk needs allreduce gather"),
    ({"sets": ["store.compression=topk", "store.topk_density=0.0001"]}, "store.topk_value_bits: 2 bits make 2"),
    ({"sets": ["store.spread=0"]}, "store.spread: must be >= 1 (got 0)"),
])
def test_invalid_values_fail_with_one_line_naming_the_field(kwargs: dict, expected: str) -> None:
    assert error_of(**kwargs).startswith(expected)


def test_cloud_backends_need_an_s3_rendezvous_and_their_required_fields() -> None:
    msg = error_of(sets=["backend.kind=sagemaker", "backend.role_arn=arn:x", "backend.image_uri=img"])
    assert msg.startswith("store.rendezvous: required for the sagemaker backend")
    # The eks backend needs no image: without one its pods run the public PyTorch image and the code channel.
    assert resolve_config(None, {"backend": "eks", "store.rendezvous": "s3://b/{run_id}"}).backend.image is None
    # The SageMaker role is checked when the launch is planned (its error lists the account's roles): see
    # tests/test_sagemaker_e2e.py.
    msg = error_of(sets=["backend.kind=eks", "backend.image=img", "store.rendezvous=file:///tmp/x"])
    assert msg.startswith("store.rendezvous: the eks backend needs an s3:// URI")


def test_yaml_problems_are_one_line(tmp_path: Path) -> None:
    assert error_of(config_path=tmp_path / "missing.yaml").startswith("--config: no such file")
    bad = write(tmp_path, "replicas: 4\ntrain: [unclosed\n")
    msg = error_of(config_path=bad)
    assert msg.startswith(f"{bad}: line ") and "invalid YAML" in msg
    assert "must be a mapping" in error_of(config_path=write(tmp_path, "- a\n- b\n"))
    assert resolve_config(write(tmp_path, "")) == RunConfig()  # an empty file is just defaults


def test_shipped_local_config_is_the_four_replica_demo() -> None:
    cfg = resolve_config(CONFIGS / "local.yaml")
    assert cfg.replicas == 4
    assert cfg.backend.kind == "local"
    assert cfg.train.trainer == "diloco.trainers.gpt:diloco_train"
    assert cfg.train.steps % cfg.train.sync_every == 0 and cfg.train.steps // cfg.train.sync_every >= 2


@pytest.mark.parametrize(("name", "model", "fills"), [
    ("sagemaker.yaml", SageMakerBackendConfig, ["backend.role_arn=arn:aws:iam::123456789012:role/r",
                                                "backend.image_uri=123456789012.dkr.ecr.us-west-2.amazonaws.com/d:1",
                                                "store.rendezvous=s3://bucket/diloco/{run_id}"]),
    ("hf-qwen.yaml", SageMakerBackendConfig, ["backend.role_arn=arn:aws:iam::123456789012:role/r",
                                              "store.rendezvous=s3://bucket/diloco/{run_id}",
                                              "train.trainer_kwargs.data=s3://bucket/corpus/"]),
    ("eks.yaml", EKSBackendConfig, ["backend.image=registry.example/diloco:1", "backend.service_account=diloco",
                                    "store.rendezvous=s3://bucket/diloco/{run_id}"]),
])
def test_shipped_cloud_configs_have_placeholders_to_fill(name: str, model: type, fills: list[str]) -> None:
    msg = error_of(config_path=CONFIGS / name)
    assert "replace the placeholder" in msg
    cfg = resolve_config(CONFIGS / name, sets=fills)
    assert isinstance(cfg.backend, model)
    assert cfg.store.rendezvous == "s3://bucket/diloco/{run_id}"

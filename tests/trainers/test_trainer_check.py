"""Trainer kwargs checked before launch: signature, annotations (with lossless coercion), the preflight hook.

The functions here are real trainers' signatures; the built-in trainer's preflight is exercised as the launcher
will call it (``check_trainer_kwargs(diloco_train, kwargs, world_size=..., on_this_machine=...)``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import pytest
import torch

import diloco
from diloco.errors import ConfigError
from diloco.trainers.gpt import diloco_train
from diloco.trainers.preflight import PreflightContext, check_trainer_kwargs, preflight_of


def typed(*, manager: Any, rank: int, world_size: int, total_steps: int = 10, lr: float = 1e-3,
          name: str = "x", flag: bool = False, limit: int | None = None, opt: Optional[float] = None,  # noqa: UP045
          mode: Literal["a", "b"] = "a", either: Union[int, str] = 0,  # noqa: UP007
          anything=None) -> None:  # deliberately unannotated
    """A trainer with one parameter of every annotation kind the checker understands."""


def untyped(*, manager, rank, world_size, total_steps=1000, sync_every=100, lr=1e-3, name="n", flag=True):
    """README's style: no annotations, defaults only."""


def needs_data(*, manager, rank, world_size, data_path, **rest):
    """A required parameter and a catch-all."""


@pytest.mark.parametrize("given, expected", [
    ({"lr": "3e-4"}, {"lr": 3e-4}),  # YAML 1.1 leaves 3e-4 a string
    ({"lr": 1}, {"lr": 1.0}),
    ({"total_steps": "12"}, {"total_steps": 12}),
    ({"total_steps": 1e3}, {"total_steps": 1000}),
    ({"flag": "yes"}, {"flag": True}),
    ({"flag": "False"}, {"flag": False}),
    ({"limit": None}, {"limit": None}),
    ({"limit": "7"}, {"limit": 7}),
    ({"opt": "0.5"}, {"opt": 0.5}),
    ({"mode": "b"}, {"mode": "b"}),
    ({"either": "text"}, {"either": "text"}),  # a string fits str exactly: kept
    ({"either": 4}, {"either": 4}),
    ({"anything": [1, 2]}, {"anything": [1, 2]}),  # not annotated: not checked
])
def test_values_are_coerced_losslessly_to_the_annotation(given: dict, expected: dict) -> None:
    out = check_trainer_kwargs(typed, given)
    assert out == expected and type(out[next(iter(out))]) is type(expected[next(iter(expected))])


@pytest.mark.parametrize("given, needle", [
    ({"lr": "fast"}, "trainer kwarg lr: expected a number, got 'fast' (str)"),
    ({"lr": True}, "trainer kwarg lr: expected a number"),
    ({"total_steps": 2.5}, "trainer kwarg total_steps: expected a whole number"),
    ({"name": 12}, "trainer kwarg name: expected a string (quote a number meant as text)"),
    ({"flag": 1}, "trainer kwarg flag: expected true or false"),
    ({"limit": "many"}, "trainer kwarg limit: expected a whole number or null"),
    ({"mode": "c"}, "trainer kwarg mode: expected one of 'a', 'b'"),
])
def test_values_that_do_not_fit_are_one_line_errors_naming_the_key(given: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_trainer_kwargs(typed, given)
    assert needle in str(info.value)
    assert info.value.hint == f"fix it with -k/--trainer-kwargs {next(iter(given))}=VALUE"


def test_signature_unknown_injected_and_missing_keys() -> None:
    with pytest.raises(ConfigError, match=r"'lrr' is not a parameter of .*typed \(did you mean 'lr'\?\)") as info:
        check_trainer_kwargs(typed, {"lrr": 0.1})
    assert "total_steps" in (info.value.hint or "")
    with pytest.raises(ConfigError, match="rank, which each replica is given by diloco"):
        check_trainer_kwargs(typed, {"rank": 1})
    with pytest.raises(ConfigError, match="needs trainer kwarg 'data_path'"):
        check_trainer_kwargs(needs_data, {})
    assert check_trainer_kwargs(needs_data, {"data_path": "/d", "whatever": 1}) == {"data_path": "/d", "whatever": 1}


def test_unannotated_parameters_convert_only_strings_of_their_defaults_kind() -> None:
    """README's trainer (``lr=1e-3``, no annotation) with ``-k lr=3e-4`` under YAML 1.1 rules."""
    out = check_trainer_kwargs(untyped, {"lr": "3e-4", "total_steps": "1e3", "sync_every": "2.5", "flag": "no",
                                         "name": 5})
    assert out == {"lr": 3e-4, "total_steps": 1000, "sync_every": 2.5, "flag": False, "name": 5}
    assert check_trainer_kwargs(untyped, {"lr": "fast"}) == {"lr": "fast"}  # nothing says it must be a number


def test_a_preflight_hook_gets_every_value_and_the_context() -> None:
    seen: list[tuple[dict, PreflightContext]] = []

    def check(kwargs: dict[str, Any], context: PreflightContext) -> None:
        seen.append((kwargs, context))
        if kwargs["lr"] > 1:
            raise ConfigError(f"lr must be <= 1, got {kwargs['lr']}")

    @diloco.preflight(check)
    def train(*, manager: Any, rank: int, world_size: int, lr: float = 0.1, steps: int = 5) -> None:
        pass

    assert preflight_of(train) is check
    assert check_trainer_kwargs(train, {"lr": "0.5"}, world_size=4, on_this_machine=True) == {"lr": 0.5}
    assert seen == [({"lr": 0.5, "steps": 5}, PreflightContext(world_size=4, on_this_machine=True))]
    with pytest.raises(ConfigError, match="lr must be <= 1, got 3.0"):
        check_trainer_kwargs(train, {"lr": 3})


# ---------------------------------------------------------------------------------------------- built-in trainer
@pytest.mark.parametrize("kwargs, needle", [
    ({"lrr": 0.1}, "'lrr' is not a parameter of diloco.trainers.gpt:diloco_train (did you mean 'lr'?)"),
    ({"n_embd": 33}, "n_embd (33) must be a multiple of n_head (2)"),
    ({"total_steps": 61, "sync_every": 20}, "total_steps (61) must be a multiple of sync_every (20)"),
    ({"fragments": 5}, "fragments must be between 1 and 4"),
    ({"fragments": 2, "sync_every": 20, "total_steps": 40, "fragment_sync_delay": 10}, "fragment_sync_delay"),
    ({"outer_momentum": 1.0}, "outer_momentum must be in [0, 1)"),
    ({"device": "gpu-please"}, "device 'gpu-please' is not a torch device"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"eval_fraction": 1.5}, "eval_fraction must be in (0, 1)"),
])
def test_the_built_in_trainer_rejects_before_launch_what_it_would_reject_at_start(kwargs: dict, needle: str) -> None:
    """Refused before any replica starts, rather than starting N replicas that all fail."""
    with pytest.raises(ConfigError) as info:
        check_trainer_kwargs(diloco_train, kwargs, world_size=2)
    assert needle in str(info.value)


def test_the_built_in_preflight_checks_this_machine_only_for_local_replicas(tmp_path) -> None:
    ok = check_trainer_kwargs(diloco_train, {"lr": "3e-4", "n_embd": 32}, world_size=2, on_this_machine=True)
    assert ok == {"lr": 3e-4, "n_embd": 32}
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no usable CUDA device"):
            check_trainer_kwargs(diloco_train, {"device": "cuda"}, world_size=2, on_this_machine=True)
    check_trainer_kwargs(diloco_train, {"device": "cuda"}, world_size=2)  # replicas elsewhere (SageMaker, EKS)
    with pytest.raises(ConfigError, match="neither a file nor a directory"):
        check_trainer_kwargs(diloco_train, {"corpus": str(tmp_path / "missing")}, world_size=2, on_this_machine=True)
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 2000)
    with pytest.raises(ConfigError, match="too small for 64 shard"):
        check_trainer_kwargs(diloco_train, {"corpus": str(small)}, world_size=64, on_this_machine=True)
    check_trainer_kwargs(diloco_train, {"corpus": str(small), "block_size": 16}, world_size=2, on_this_machine=True)

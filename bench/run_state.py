"""A convergence run's whole state in one safetensors file, so a long run can stop and go on bit for bit.

Why: the runs that decide how far the compressed formats trail fp32 DiLoCo are hundreds of rounds, the better part
of an hour each on a core, and the answer of one length asks for a longer one. Without a saved state a run to 800
rounds redoes the 576 it already had, and a run killed at round 700 loses them all. ``bench/convergence.py``'s
``run_diloco`` saves this state every few rounds and at the end and, given the same file again, goes on from it:
with the same setting (a longer ``steps`` allowed while the inner lr is constant, since a cosine schedule depends
on the run's length) the curve and the weights are those of one uninterrupted run.

What it holds: every replica's weights, AdamW state and batch generator (its place in its shard), the outer step's
fp32 global weights and momentum buffers, every replica's error-feedback residuals, the eval curve so far, the
step reached, the seconds spent and the machine of the latest save (a report built from kept runs names where they
ran). Tensors go into safetensors with the rest as JSON in its metadata; one file, replaced atomically (written
beside it, then renamed), so a kill mid-save leaves the previous state whole.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from convergence import OuterStep, Replica, Result, Setting

#: Bumped when what the file holds changes, so an old file is refused rather than misread.
VERSION = 1


class StateMismatch(SystemExit):
    """A saved state that is not this run's: its setting differs, or it went past the steps asked for."""


def _comparable(setting: Setting) -> dict[str, Any]:
    """The setting as the state records it: every field but ``steps`` unless the schedule depends on it."""
    fields = dataclasses.asdict(setting)
    if setting.min_lr_ratio >= 1:
        fields.pop("steps")
    return fields


def save_run(path: Path, setting: Setting, replicas: list[Replica], outer: OuterStep, result: Result,
             step: int, seconds: float) -> None:
    """Write the run's state after ``step`` inner steps (a round boundary) to ``path``, atomically."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for rank, r in enumerate(replicas):
        for name, t in r.model.state_dict().items():
            tensors[f"replica{rank}.model.{name}"] = t.detach().clone()  # tied weights: one copy per name
        for index, state in r.opt.state_dict()["state"].items():
            for key, t in state.items():
                tensors[f"replica{rank}.adamw.{index}.{key}"] = t.detach().clone().reshape(-1)
        tensors[f"replica{rank}.generator"] = r.gen.get_state().clone()
    for name, t in outer.global_params.items():
        tensors[f"outer.global.{name}"] = t.detach().clone()
    for index, state in outer.opt.state_dict()["state"].items():
        if state.get("momentum_buffer") is not None:
            tensors[f"outer.momentum.{index}"] = state["momentum_buffer"].detach().clone()
    for rank, residuals in enumerate(outer.feedback_state()):
        for name, t in residuals.items():
            tensors[f"outer.feedback{rank}.{name}"] = t
    from run_all import machine, machine_line

    record = {"version": VERSION, "setting": _comparable(setting), "step": step,
              "seconds": seconds, "rounds": outer.rounds, "round_bytes": outer.round_bytes,
              "round_wire_bytes": outer.round_wire_bytes, "curve": result.curve,
              "machine": machine_line(machine())}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata={"run": json.dumps(record)})
    os.replace(partial, path)


def _record(path: Path) -> dict[str, Any]:
    """The JSON part of a saved run, read from the file's header alone (no tensor is loaded); ``StateMismatch``
    when the file is not a state this script writes."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        record = json.loads((f.metadata() or {}).get("run", "{}"))
    if record.get("version") != VERSION:
        raise StateMismatch(f"{path}: not a run state this script writes (version {record.get('version')!r}, "
                            f"expected {VERSION}); move it away to start the run afresh")
    return record


def saved_result(path: Path) -> tuple[Result, str | None]:
    """A saved run as it stands, as its ``Result`` (its setting with ``steps`` the step it reached, its curve, its
    bytes per round and seconds), and the machine line of its latest save (None in a state saved before runs
    recorded it): from the header alone, so a run still writing its state can be looked at while it trains."""
    from convergence import Result, Setting

    record = _record(path)
    fields = {**record["setting"], "steps": int(record["step"])}
    result = Result("diloco", Setting(**fields), [(int(s), float(v)) for s, v in record["curve"]],
                    seconds=float(record["seconds"]), round_bytes=int(record["round_bytes"]),
                    round_wire_bytes=int(record["round_wire_bytes"]))
    return result, record.get("machine")


def load_run(path: Path, setting: Setting, replicas: list[Replica], outer: OuterStep, result: Result
             ) -> tuple[int, float]:
    """Put the run saved at ``path`` into ``replicas``, ``outer`` and ``result``: -> (steps done, seconds spent).
    ``StateMismatch`` (naming what differs) when it is another run's or went past ``setting.steps``."""
    from safetensors.torch import load_file

    record = _record(path)
    saved, wanted = record["setting"], json.loads(json.dumps(_comparable(setting)))
    differ = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
    if differ:
        what = ", ".join(f"{k} {saved.get(k)!r} there, {wanted.get(k)!r} here" for k in differ)
        raise StateMismatch(f"{path} is another run's ({what}): use another state file, or that run's setting")
    if record["step"] > setting.steps:
        raise StateMismatch(f"{path} is at step {record['step']}, past this run's {setting.steps}: ask for at least "
                            f"{record['step']} steps")
    tensors = load_file(str(path))
    for rank, r in enumerate(replicas):
        model, adamw = f"replica{rank}.model.", f"replica{rank}.adamw."
        r.model.load_state_dict({name[len(model):]: t for name, t in tensors.items() if name.startswith(model)})
        params = r.opt.param_groups[0]["params"]
        states: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            if name.startswith(adamw):
                index, key = name[len(adamw):].split(".", 1)
                states.setdefault(int(index), {})[key] = t.reshape(() if key == "step" else params[int(index)].shape)
        opt = r.opt.state_dict()
        opt["state"] = states
        r.opt.load_state_dict(opt)
        r.gen.set_state(tensors[f"replica{rank}.generator"])
    with torch.no_grad():
        for name, g in outer.global_params.items():
            g.copy_(tensors[f"outer.global.{name}"])
    outer_state = outer.opt.state_dict()
    outer_state["state"] = {int(name.rsplit(".", 1)[1]): {"momentum_buffer": t}
                            for name, t in tensors.items() if name.startswith("outer.momentum.")}
    outer.opt.load_state_dict(outer_state)
    residuals: list[dict[str, torch.Tensor]] = [{} for _ in replicas]
    for name, t in tensors.items():
        if name.startswith("outer.feedback"):
            rank, tensor_name = name[len("outer.feedback"):].split(".", 1)
            residuals[int(rank)][tensor_name] = t
    outer.load_feedback_state(residuals)
    outer.rounds, outer.round_bytes = record["rounds"], record["round_bytes"]
    outer.round_wire_bytes = record["round_wire_bytes"]
    result.curve = [(int(s), float(v)) for s, v in record["curve"]]
    return int(record["step"]), float(record["seconds"])

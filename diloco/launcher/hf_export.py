"""A run's model as a Hugging Face ``save_pretrained`` directory (``diloco collect --hf DIR``).

Why from two sources: the agreed weights (the model ``collect`` checked bitwise across replicas) are the truth,
and the Hugging Face trainer (``diloco.trainers.hf``) also leaves ``hf_model/`` in the run's store: rank 0's
``save_pretrained`` with the tokenizer. The directory written here takes everything but the weights from
``hf_model/`` (``config.json``, ``generation_config.json``, the tokenizer files) and writes ``model.safetensors``
from the agreed weights, under the tensor names ``save_pretrained`` used (tied copies left out as it leaves them
out). So it holds exactly the collected weights, loads with ``from_pretrained``, and is what
``huggingface_hub.upload_folder`` takes as is: plain files, no diloco metadata beyond ``format: pt``.

A run of another trainer has no config or tokenizer to give: asking for ``--hf`` then fails before anything is
waited for or written (``check_hf_run``). The directory is staged beside its final path and renamed into place,
so an interrupted export never leaves half a model under the name.

torch, safetensors and transformers are imported inside the functions: the CLI imports this module.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError, CorruptObjectError, DilocoError

if TYPE_CHECKING:
    import torch

    from diloco.store.objects import ObjectStore

#: Where the Hugging Face trainer leaves its ``save_pretrained`` directory in the run's store (its ``HF_MODEL_PREFIX``;
#: repeated here because the launcher reads the trainer's module only as text).
HF_MODEL_PREFIX = "hf_model/"
#: Trainer references whose runs leave ``hf_model/`` (the module part of ``train.trainer``).
HF_TRAINER_MODULES = ("diloco.trainers.hf",)
#: The weights file written (one file: ``from_pretrained`` and ``upload_folder`` take any size).
WEIGHTS_FILE = "model.safetensors"
#: Files of ``hf_model/`` that hold weights: replaced by the agreed weights, never copied.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
#: Files ``AutoTokenizer.from_pretrained`` can read a tokenizer from (any one is enough).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


@dataclass
class HfExport:
    """What ``export_hf`` wrote: the directory, its files, and the weights it holds."""

    path: str
    files: list[str]
    tensor_count: int
    value_count: int
    dropped: list[str] = field(default_factory=list)  # collected tensors save_pretrained leaves out (tied copies)


def is_hf_run(config: Mapping[str, Any], store: ObjectStore | None = None) -> bool:
    """Whether a run (its recorded config) trained a Hugging Face model: its trainer is the HF trainer, or its
    store already holds ``hf_model/config.json`` (a user's trainer that calls the HF trainer's ``save_model``)."""
    trainer = str((config.get("train") or {}).get("trainer") or "")
    if trainer.split(":", 1)[0] in HF_TRAINER_MODULES:
        return True
    return store is not None and store.exists(HF_MODEL_PREFIX + "config.json")


def check_hf_run(config: Mapping[str, Any], store: ObjectStore | None = None) -> None:
    """``ConfigError`` (exit 2, nothing waited for) unless the run trained a Hugging Face model."""
    if not is_hf_run(config, store):
        trainer = (config.get("train") or {}).get("trainer") or "?"
        raise ConfigError(f"--hf: run trained with {trainer}, not a Hugging Face model: it has no config or "
                          f"tokenizer to write", hint="--hf needs a run of diloco.trainers.hf:train; collect the "
                                                      "weights without --hf")


def check_target(directory: str, *, force: bool = False) -> str:
    """The absolute ``--hf`` directory, checked before waiting: it must not exist, or be an empty directory, or
    (with ``force``) a directory to replace. Its parent must be creatable."""
    from diloco.launcher.output_path import check_can_create

    path = os.path.abspath(os.path.expanduser(directory))
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError(f"--hf: {path} is a file, not a directory", hint="name a new or empty directory")
        if os.listdir(path) and not force:
            raise ConfigError(f"--hf: {path} is not empty", hint="name a new or empty directory, or pass --force "
                                                                 "to replace it")
    check_can_create(os.path.dirname(path), option="--hf")
    return path


def export_hf(store: ObjectStore, weights_file: str, directory: str, *, force: bool = False) -> HfExport:
    """Write the ``save_pretrained`` directory of the agreed weights in ``weights_file`` (the model ``collect``
    wrote) to ``directory``, with the config and tokenizer of the store's ``hf_model/`` (see the module docstring).
    Raises ``DilocoError`` naming what is missing (no ``hf_model/``, no tokenizer, weights ``save_pretrained``
    holds that the collected ones lack); nothing is left under ``directory`` then."""
    from safetensors.torch import load_file, save_file

    path = check_target(directory, force=force)
    keys = [k for k in store.list(HF_MODEL_PREFIX) if "/" not in k[len(HF_MODEL_PREFIX):]]
    names = {k[len(HF_MODEL_PREFIX):]: k for k in keys}
    if "config.json" not in names:
        raise DilocoError(f"{store.url(HF_MODEL_PREFIX)} holds no config.json: the trainer did not save the model "
                          f"with save_pretrained", hint="the run must end normally (its rank 0 writes hf_model/)")
    if not any(name in names for name in _TOKENIZER_FILES):
        raise DilocoError(f"{store.url(HF_MODEL_PREFIX)} holds no tokenizer ({', '.join(_TOKENIZER_FILES)})",
                          hint="the trainer saves its tokenizer beside the model; rerun with a tokenizer")
    tensors = load_file(weights_file)
    hf_names = _saved_tensor_names(store, names)
    chosen, dropped = _choose(tensors, hf_names, source=weights_file)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", dir=parent)
    try:
        files = []
        for name, key in sorted(names.items()):
            if name.endswith(_WEIGHT_SUFFIXES):
                continue
            with open(os.path.join(staging, name), "wb") as f:
                f.write(store.get(key))
            files.append(name)
        save_file(chosen, os.path.join(staging, WEIGHTS_FILE), metadata={"format": "pt"})
        files.append(WEIGHTS_FILE)
        _replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return HfExport(path=path, files=sorted(files), tensor_count=len(chosen),
                    value_count=sum(t.numel() for t in chosen.values()), dropped=dropped)


def _saved_tensor_names(store: ObjectStore, names: Mapping[str, str]) -> set[str] | None:
    """The tensor names the trainer's ``save_pretrained`` wrote (from the safetensors headers or the shard index,
    no tensor read), or None when ``hf_model/`` holds no safetensors weights."""
    index = next((n for n in names if n.endswith(".safetensors.index.json")), None)
    if index is not None:
        weight_map = json.loads(store.get(names[index])).get("weight_map") or {}
        return set(weight_map)
    files = [n for n in names if n.endswith(".safetensors")]
    if not files:
        return None
    found: set[str] = set()
    for name in files:
        head = store.get_range(names[name], 0, 8)
        size = int.from_bytes(bytes(head), "little")
        header = json.loads(bytes(store.get_range(names[name], 8, 8 + size)))
        found |= {k for k in header if k != "__metadata__"}
    return found


def _choose(tensors: dict[str, torch.Tensor], hf_names: set[str] | None,
            *, source: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The collected tensors under ``save_pretrained``'s names: all of them when its names are unknown; else its
    names, every one of which the collected weights must hold (the rest, tied copies, are dropped)."""
    if hf_names is None:
        return {k: v.contiguous() for k, v in tensors.items()}, []
    missing = sorted(hf_names - set(tensors))
    if missing:
        raise CorruptObjectError(f"{source} lacks {len(missing)} tensor(s) the trainer's save_pretrained holds "
                                 f"(first: {missing[0]}): the collected weights are not this model's",
                                 hint="collect the run again; its hf_model/ and final weights disagree")
    return ({k: tensors[k].contiguous() for k in sorted(hf_names)},
            sorted(set(tensors) - hf_names))


def _replace(staging: str, path: str) -> None:
    """Move the staged directory to ``path``, replacing an existing (checked: empty, or ``--force``) one."""
    if os.path.isdir(path):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old.", dir=os.path.dirname(path))
        os.rmdir(old)
        os.rename(path, old)
        os.rename(staging, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, path)


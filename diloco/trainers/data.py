"""The built-in trainer's data: a real text corpus that exists on every machine, as bytes, split per rank.

The default corpus is the Python standard library's own top-level ``*.py`` files, read in name order and
truncated: every replica image has them, nothing is downloaded, and replicas built from one image read the same
bytes. The vocabulary is the 256 byte values, so there is no tokenizer to ship either.

Splits: the last ``eval_fraction`` of the corpus is a held-out evaluation region, identical for all ranks.
The rest is the training region, cut into ``world_size`` contiguous, disjoint shards; rank ``r`` trains only on
shard ``r`` (DiLoCo's data-parallel setting: replicas see different data and meet only at outer steps).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco.errors import ConfigError

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_CORPUS_BYTES = 2_000_000
#: Between concatenated files, so a sample that spans two files still sees a boundary.
_FILE_SEPARATOR = b"\n\n"


def stdlib_dir() -> str:
    """The directory of the running interpreter's standard library (where ``os.py`` lives)."""
    return os.path.dirname(os.path.abspath(os.__file__))


def corpus_files(path: str | None = None) -> list[str]:
    """The files the corpus is read from, in the fixed order they are concatenated.

    ``None``: the standard library's top-level ``*.py`` files sorted by name. A file: that file. A directory:
    every non-hidden regular file below it, sorted by relative path.
    """
    if path is None:
        root = stdlib_dir()
        return [os.path.join(root, n) for n in sorted(os.listdir(root))
                if n.endswith(".py") and os.path.isfile(os.path.join(root, n))]
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        found: list[str] = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            found += [os.path.join(dirpath, f) for f in filenames if not f.startswith(".")]
        return sorted(found, key=lambda p: os.path.relpath(p, path))
    raise ConfigError(f"corpus {path!r} is neither a file nor a directory",
                      hint="pass an existing path, or omit corpus to use the Python standard library")


def load_corpus(path: str | None = None, max_bytes: int = DEFAULT_MAX_CORPUS_BYTES) -> bytes:
    """The corpus bytes: the files of ``corpus_files(path)`` joined in order, truncated to ``max_bytes``."""
    if max_bytes < 1:
        raise ConfigError(f"max_corpus_bytes must be >= 1, got {max_bytes}")
    chunks: list[bytes] = []
    size = 0
    for f in corpus_files(path):
        if size >= max_bytes:
            break
        with open(f, "rb") as fh:
            data = fh.read(max_bytes - size)
        chunks += [data, _FILE_SEPARATOR]
        size += len(data) + len(_FILE_SEPARATOR)
    corpus = b"".join(chunks)[:max_bytes]
    if not corpus:
        raise ConfigError(f"corpus {path or stdlib_dir()!r} is empty", hint="point corpus at a non-empty text file")
    return corpus


@dataclass(frozen=True)
class Split:
    """One rank's view of the corpus: its training shard and the shared evaluation region (int64 byte ids)."""

    train: torch.Tensor
    eval: torch.Tensor
    train_range: tuple[int, int]  # [start, end) byte offsets of this rank's shard in the corpus
    eval_range: tuple[int, int]


def split_corpus(corpus: bytes, *, rank: int, world_size: int, block_size: int,
                 eval_fraction: float = 0.1) -> Split:
    """Rank ``rank``'s disjoint training shard and the common held-out tail, validated to fit ``block_size``."""
    import torch

    if not 0.0 < eval_fraction < 1.0:
        raise ConfigError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside 0..{world_size - 1}")
    n_train = int(len(corpus) * (1.0 - eval_fraction))
    shard = n_train // world_size
    need = block_size + 2  # one window of inputs plus its shifted targets, and at least two start offsets
    if shard < need or len(corpus) - n_train < need:
        raise ConfigError(
            f"corpus of {len(corpus)} bytes is too small for {world_size} shard(s) and an eval split of "
            f"block_size {block_size} (each needs >= {need} bytes)",
            hint="raise max_corpus_bytes, use a larger corpus or lower block_size",
        )
    start = rank * shard
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).to(torch.long)
    return Split(
        train=data[start:start + shard].clone(),
        eval=data[n_train:].clone(),
        train_range=(start, start + shard),
        eval_range=(n_train, len(corpus)),
    )


def sample_batch(data: torch.Tensor, *, batch_size: int, block_size: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows ``x`` and their next-byte targets ``y``, both ``(batch_size, block_size)``."""
    import torch

    starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=generator)
    x = torch.stack([data[s:s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts.tolist()])
    return x, y


def eval_batches(data: torch.Tensor, *, n_batches: int, batch_size: int, block_size: int,
                 seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of evaluation batches (same ``seed`` -> same batches on every rank, every round).

    Evaluating on the same windows each round makes the loss curve comparable across rounds and ranks.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    return [sample_batch(data, batch_size=batch_size, block_size=block_size, generator=g)
            for _ in range(n_batches)]

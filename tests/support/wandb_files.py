"""Reads the records of a W&B run's ``.wandb`` file: the transaction log an offline run writes and ``wandb sync``
uploads (wandb 0.2x+ has no Python reader of its own left; its Go core writes the file).

The format, as wandb's former ``wandb/sdk/internal/datastore.py`` and its Go core's ``leveldb`` writer define it: a
7-byte file header (``:W&B``, the magic ``0xBEE1`` little-endian, version 0 or 1), then LevelDB's log format
(blocks of 32 KiB; each chunk a 7-byte header: CRC-32C (4), length (2, little-endian), type (1: full, 2: first,
3: middle, 4: last); a block's tail shorter than a header is padding). Each record is one serialized
``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: Path) -> Iterator[bytes]:
    """Every record's bytes, in order."""
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1 and version in (0, 1), (ident, magic, version)
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left  # the block's padding
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""
        elif kind == 0 and length == 0:
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0  # zeroed tail of a block
        else:
            raise AssertionError(f"{path}: chunk type {kind} at {pos}")


def read_run(path: Path) -> dict[str, Any]:
    """A ``.wandb`` file's run id, config and history rows (each a dict of the logged keys)."""
    from wandb.proto import wandb_internal_pb2

    run_id, config, history = None, {}, []
    for blob in raw_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(blob)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            for item in record.run.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return {"run_id": run_id, "config": config, "history": history}

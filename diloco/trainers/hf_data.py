"""Streamed data for the Hugging Face trainer: read as training goes, never tokenized or loaded whole at start.

Two kinds of ``data=`` are streamed (anything else is the in-memory text path of ``diloco.trainers.hf``):

* ``hf:NAME[:CONFIG][@SPLIT]``: a ``datasets`` dataset, ``load_dataset(NAME, CONFIG, split=SPLIT,
  streaming=True)`` (split ``train`` by default). ``NAME`` may also be a local directory written by
  ``save_to_disk`` (``load_from_disk``) or a local Parquet file or directory (read as a streamed Parquet dataset).
  Each row's ``text_field`` is tokenized when it is reached (EOS appended); a row without it but with a list of
  token ids in ``token_field`` is used as it is.
* **Pre-tokenized shards**: a local directory or file, or an ``s3://`` prefix, holding ``.bin`` (raw token ids,
  ``token_dtype``, default ``uint16``), ``.npy`` (one 1-D array each) or Parquet files whose ``token_field``
  column (default ``input_ids``) holds lists of token ids. Files are read in name order, one at a time (a local
  ``.bin``/``.npy`` is memory-mapped); no tokenizer is run.

Dealing, identical on every machine, with ``slots = world_size * local processes`` and each process one slot:

* the held-out split is the start of the stream: its first ``n_eval`` blocks, the same on every rank;
* pre-tokenized shards: each file is cut into ``block_size`` blocks (its ragged tail dropped); counting the blocks
  of all files in order after the held-out ones, block ``t`` goes to slot ``t % slots``;
* ``hf:``: counting the rows after those the held-out split used, row ``i`` goes to slot ``i % slots``; a slot
  packs its rows' tokens into ``block_size`` blocks, carrying the remainder over to the next row.

When a stream ends the next epoch starts it again (same order, held-out part skipped again).

The position is small and exact, a JSON object (``state_dict``): the epoch, the next file and block (shards), or the
next row and the tokens carried over (``hf:``). ``load_state_dict`` continues from it without re-reading what came
before it (an ``hf:`` stream is reopened with ``skip``: skipped rows are read, never tokenized). The trainer saves
it with every committed round (``diloco.trainers.data_positions``) and restores it on rejoin.

``datasets`` (the ``hf`` extra) and ``numpy`` are imported only when a stream is opened.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch

HF_SCHEME = "hf:"
TOKEN_SUFFIXES = (".bin", ".npy")
PARQUET_SUFFIXES = (".parquet",)
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
#: The format tag of a saved position: a position of another kind of stream is refused, not misread.
POSITION_FORMATS = {"shards": "diloco.token-shards/1", "hf": "diloco.hf-stream/1"}


@dataclass(frozen=True)
class HFSource:
    """``hf:NAME[:CONFIG][@SPLIT]`` taken apart."""

    name: str
    config: str | None
    split: str

    @property
    def local(self) -> bool:
        return os.path.exists(os.path.expanduser(self.name))


def parse_hf(data: str) -> HFSource:
    """``hf:NAME[:CONFIG][@SPLIT]`` as its parts; ``ConfigError`` naming ``data`` when NAME is empty."""
    rest = data.removeprefix(HF_SCHEME)
    rest, _, split = rest.rpartition("@") if "@" in rest else (rest, "", "")
    name, _, config = rest.partition(":")
    if not name:
        raise ConfigError(f"data: {data!r} names no dataset", hint="use hf:NAME[:CONFIG][@SPLIT], e.g. "
                          "hf:roneneldan/TinyStories@train, or hf:./my_saved_dataset")
    return HFSource(name=name, config=config or None, split=split or "train")


def is_streamed(data: str, *, text_field: str = "text", token_field: str = "input_ids") -> bool:
    """Whether ``data`` is read as a stream (``hf:`` or pre-tokenized shards) rather than tokenized whole."""
    if data.startswith(HF_SCHEME):
        return True
    return bool(token_files(data, text_field=text_field, token_field=token_field, probe=True))


# ------------------------------------------------------------------------------------------------ token shards
@dataclass(frozen=True)
class TokenFile:
    """One file of token ids: its name and how to read it as a 1-D integer array."""

    name: str
    read: Callable[[], np.ndarray]


def token_files(data: str, *, text_field: str = "text", token_field: str = "input_ids", token_dtype: str = "uint16",
                probe: bool = False) -> list[TokenFile]:
    """The pre-tokenized files under ``data`` (a local file or directory, or a store URI), in name order: every
    ``.bin``/``.npy`` file, and the Parquet files when the first one has a ``token_field`` column and no
    ``text_field`` one (text Parquet is the text path's; only the first file's schema is read). Empty when ``data``
    holds none. ``probe``: only find out whether there are any."""
    local = "://" not in data or data.startswith("file://")
    path = data.removeprefix("file://")
    if local:
        if os.path.isfile(path):
            names, root = [os.path.basename(path)], os.path.dirname(path)
        elif os.path.isdir(path):
            names, root = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path)
                                 for f in fs), path
        else:
            return []
    else:
        from diloco.store.objects import ObjectStore

        store = ObjectStore(data)
        names, root = store.list(), ""
    found: list[TokenFile] = []
    parquet_kind: bool | None = None  # whether this data's Parquet files hold token ids (the first one says)
    for name in names:
        lower = name.lower()
        if os.path.basename(name).startswith("."):
            continue
        if lower.endswith(PARQUET_SUFFIXES) and parquet_kind is None:
            parquet_kind = _token_parquet(_bytes_of(data, root, name, local), name, text_field, token_field)
        if lower.endswith(TOKEN_SUFFIXES) or (lower.endswith(PARQUET_SUFFIXES) and parquet_kind):
            found.append(TokenFile(name, _reader(data, root, name, local, token_field, token_dtype)))
            if probe:
                return found
    return found


def _bytes_of(data: str, root: str, name: str, local: bool) -> Callable[[], Any]:
    """A local file's path, or a stored object's bytes (as a file-like), for pyarrow."""
    if local:
        return lambda: os.path.join(root, name)
    from diloco.store.objects import ObjectStore

    return lambda: io.BytesIO(ObjectStore(data).get(name))


def _token_parquet(source: Callable[[], Any], name: str, text_field: str, token_field: str) -> bool:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"data: {name} is Parquet, which needs pyarrow", hint="pip install pyarrow") from None
    columns = pq.read_schema(source()).names
    return token_field in columns and text_field not in columns


def _reader(data: str, root: str, name: str, local: bool, token_field: str,
            token_dtype: str) -> Callable[[], np.ndarray]:
    lower = name.lower()

    def read() -> np.ndarray:
        import numpy as np

        if lower.endswith(".npy"):
            if local:
                array = np.load(os.path.join(root, name), mmap_mode="r", allow_pickle=False)
            else:
                array = np.load(_bytes_of(data, root, name, local)(), allow_pickle=False)
            if array.ndim != 1 or array.dtype.kind not in "iu":
                raise ConfigError(f"data: {name} holds a {array.ndim}-D {array.dtype} array, not 1-D token ids",
                                  hint="save each shard as a 1-D integer array (np.save(path, ids))")
            return array
        if lower.endswith(".bin"):
            if local:
                return np.memmap(os.path.join(root, name), dtype=token_dtype, mode="r")
            return np.frombuffer(_bytes_of(data, root, name, local)().getvalue(), dtype=token_dtype)
        import pyarrow.parquet as pq

        rows = pq.read_table(_bytes_of(data, root, name, local)(), columns=[token_field]).column(0).to_pylist()
        return np.asarray([t for row in rows if row for t in row], dtype=np.int64)

    return read


class TokenShardStream:
    """Blocks of pre-tokenized files, dealt block by block to ``slots`` slots (see the module docstring)."""

    kind = "shards"

    def __init__(self, files: list[TokenFile], *, block_size: int, slot: int, slots: int, n_eval: int,
                 source: str) -> None:
        if not files:
            raise ConfigError(f"data: no .bin/.npy/token Parquet files under {source}",
                              hint="point data at the folder or prefix holding the token shards")
        self.files, self.block_size, self.slot, self.slots, self.n_eval = files, block_size, slot, slots, n_eval
        self.source = source
        self._cached: tuple[int, np.ndarray] | None = None
        self.epoch, self.file, self.block, self.index = 0, 0, 0, -n_eval
        self.eval_blocks = self._eval()

    def _array(self, file: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != file:
            self._cached = (file, self.files[file].read())
        return self._cached[1]

    def _eval(self) -> torch.Tensor:
        import numpy as np
        import torch

        blocks: list[np.ndarray] = []
        for file in range(len(self.files)):
            array = self._array(file)
            for k in range(min(len(array) // self.block_size, self.n_eval - len(blocks))):
                blocks.append(np.asarray(array[k * self.block_size:(k + 1) * self.block_size], dtype=np.int64))
            if len(blocks) == self.n_eval:
                return torch.from_numpy(np.stack(blocks))
        raise ConfigError(f"data: {self.source} holds fewer than {self.n_eval} blocks of {self.block_size} tokens "
                          f"for the held-out split", hint="add data, or lower block_size or eval_batches")

    def next_block(self) -> np.ndarray:
        wraps = 0
        while True:
            if self.file == len(self.files):
                wraps += 1
                if wraps > 1:
                    raise ConfigError(f"data: {self.source} has no training block for slot {self.slot} of "
                                      f"{self.slots} (replicas x local processes)",
                                      hint="add data, lower block_size, or use fewer replicas")
                self.epoch, self.file, self.block, self.index = self.epoch + 1, 0, 0, -self.n_eval
            n = len(self._array(self.file)) // self.block_size
            skip = -self.index if self.index < 0 else (self.slot - self.index) % self.slots
            skip = min(skip, n - self.block)
            self.block, self.index = self.block + skip, self.index + skip
            if self.block >= n:
                self.file, self.block = self.file + 1, 0
                continue
            if self.index >= 0 and self.index % self.slots == self.slot:
                start = self.block * self.block_size
                self.block, self.index = self.block + 1, self.index + 1
                return self._array(self.file)[start:start + self.block_size]

    def state_dict(self) -> dict[str, Any]:
        return {"format": POSITION_FORMATS[self.kind], "epoch": self.epoch, "file": self.file,
                "file_name": self.files[self.file].name if self.file < len(self.files) else None,
                "block": self.block, "index": self.index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_format(state, self.kind)
        file = int(state["file"])
        if not 0 <= file <= len(self.files) or (file < len(self.files) and state.get("file_name")
                                                 != self.files[file].name):
            raise ValueError(f"data position {dict(state)} does not fit the files under {self.source}")
        self.epoch, self.file, self.block, self.index = int(state["epoch"]), file, int(state["block"]), \
            int(state["index"])

    def take(self, count: int) -> torch.Tensor:
        return _stack([self.next_block() for _ in range(count)])

    def advance(self, count: int) -> None:
        for _ in range(count):
            self.next_block()


# ------------------------------------------------------------------------------------------------ hf: datasets
class HFStream:
    """Rows of a ``datasets`` dataset, dealt row by row to ``slots`` slots, tokenized and packed as they come."""

    kind = "hf"

    def __init__(self, open_rows: Callable[[int], Iterator[Mapping[str, Any]]], tokens: Callable[[Mapping[str, Any]],
                 list[int]], *, block_size: int, slot: int, slots: int, n_eval: int, source: str) -> None:
        self.open_rows, self.tokens, self.block_size = open_rows, tokens, block_size
        self.slot, self.slots, self.n_eval, self.source = slot, slots, n_eval, source
        self.eval_blocks, self.first_row = self._eval()
        self.epoch, self.row, self.buffer = 0, self.first_row, []
        self._rows: Iterator[Mapping[str, Any]] | None = None

    def _eval(self) -> tuple[torch.Tensor, int]:
        import torch

        need, ids, used = self.n_eval * self.block_size, [], 0
        for row in self.open_rows(0):
            ids += self.tokens(row)
            used += 1
            if len(ids) >= need:
                return torch.tensor(ids[:need], dtype=torch.long).view(self.n_eval, self.block_size), used
        raise ConfigError(f"data: {self.source} holds {len(ids)} tokens, fewer than the held-out split's {self.n_eval} "
                          f"blocks of {self.block_size}", hint="add data, or lower block_size or eval_batches")

    def next_block(self) -> list[int]:
        wraps = 0
        while len(self.buffer) < self.block_size:
            if self._rows is None:
                self._rows = self.open_rows(self.row)
            row = next(self._rows, None)
            if row is None:
                wraps += 1
                if wraps > 1:
                    raise ConfigError(f"data: {self.source} has too few rows for slot {self.slot} of {self.slots} "
                                      f"(replicas x local processes) to fill a block of {self.block_size} tokens",
                                      hint="add data, lower block_size, or use fewer replicas")
                self.epoch, self.row, self._rows = self.epoch + 1, self.first_row, None
                continue
            if (self.row - self.first_row) % self.slots == self.slot:
                self.buffer += self.tokens(row)
            self.row += 1
        block, self.buffer = self.buffer[:self.block_size], self.buffer[self.block_size:]
        return block

    def state_dict(self) -> dict[str, Any]:
        return {"format": POSITION_FORMATS[self.kind], "epoch": self.epoch, "row": self.row,
                "carry": list(self.buffer)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_format(state, self.kind)
        row, carry = int(state["row"]), state["carry"]
        if row < self.first_row or not isinstance(carry, list):
            raise ValueError(f"data position {dict(state)} does not fit {self.source}")
        self.epoch, self.row, self.buffer, self._rows = int(state["epoch"]), row, [int(t) for t in carry], None

    def take(self, count: int) -> torch.Tensor:
        return _stack([self.next_block() for _ in range(count)])

    def advance(self, count: int) -> None:
        for _ in range(count):
            self.next_block()


def open_hf_rows(source: HFSource, data: str) -> Callable[[int], Iterator[Mapping[str, Any]]]:
    """``rows(n)``: the dataset's rows from row ``n`` on (a streamed dataset ``skip``s the first ``n``)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data: {data} needs the datasets library", hint="pip install 'diloco[hf-data]' (a job without --image gets it from the bootstrap)") from None
    path = os.path.expanduser(source.name)
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in
                                   ("dataset_info.json", "state.json", "dataset_dict.json")):
        saved = datasets.load_from_disk(path)
        if isinstance(saved, datasets.DatasetDict):
            if source.split not in saved:
                raise ConfigError(f"data: {data} has no split {source.split!r} (splits: {', '.join(saved)})",
                                  hint="name one with @SPLIT")
            saved = saved[source.split]
        table = saved
        return lambda n: iter(table.select(range(n, len(table)))) if n else iter(table)
    if os.path.exists(path):
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.lower().endswith(PARQUET_SUFFIXES))
        if not files:
            raise ConfigError(f"data: {data} is neither a save_to_disk directory nor Parquet",
                              hint="use hf:<directory written by save_to_disk>, or a Parquet file or folder")
        stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    else:
        stream = datasets.load_dataset(source.name, source.config, split=source.split, streaming=True)
    return lambda n: iter(stream.skip(n)) if n else iter(stream)


def row_tokens(tokenizer: Any, *, text_field: str, token_field: str, source: str) -> Callable[[Mapping[str, Any]],
                                                                                              list[int]]:
    """A row's token ids: its ``text_field`` tokenized with EOS appended, or its ``token_field`` ids as they are."""
    eos = tokenizer.eos_token_id if tokenizer is not None else None

    def tokens(row: Mapping[str, Any]) -> list[int]:
        text = row.get(text_field)
        if isinstance(text, str):
            if tokenizer is None:
                raise ConfigError(f"data: {source} holds text, which needs a tokenizer", hint="pass -k tokenizer=")
            return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + ([eos] if eos is not None else [])
        ids = row.get(token_field)
        if isinstance(ids, list):
            return [int(t) for t in ids]
        raise ConfigError(f"data: {source} has a row without a string {text_field!r} or a token list "
                          f"{token_field!r} (columns: {', '.join(row)})",
                          hint="set text_field or token_field to the column to read")

    return tokens


# ------------------------------------------------------------------------------------------------ opening
Stream = TokenShardStream | HFStream


def open_stream(data: str, tokenizer: Any, *, block_size: int, slot: int, slots: int, n_eval: int,
                text_field: str = "text", token_field: str = "input_ids", token_dtype: str = "uint16") -> Stream:
    """The stream ``data`` names, for slot ``slot`` of ``slots``, its first ``n_eval`` blocks held out."""
    if data.startswith(HF_SCHEME):
        source = parse_hf(data)
        rows = open_hf_rows(source, data)
        return HFStream(rows, row_tokens(tokenizer, text_field=text_field, token_field=token_field, source=data),
                        block_size=block_size, slot=slot, slots=slots, n_eval=n_eval, source=data)
    files = token_files(data, text_field=text_field, token_field=token_field, token_dtype=token_dtype)
    return TokenShardStream(files, block_size=block_size, slot=slot, slots=slots, n_eval=n_eval, source=data)


def check_data(values: Mapping[str, Any], *, on_this_machine: bool) -> None:
    """The streamed-data knobs checked (``ConfigError`` naming the knob): ``token_dtype``, ``token_field`` and an
    ``hf:`` value; ``on_this_machine``: that a Hub dataset can be reached from here (or ``datasets`` is missing)."""
    dtype = values.get("token_dtype", "uint16")
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(f"token_dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    if not isinstance(values.get("token_field", "input_ids"), str):
        raise ConfigError(f"token_field must be a string, got {values['token_field']!r}")
    data = values.get("data")
    if not isinstance(data, str) or not data.startswith(HF_SCHEME):
        return
    source = parse_hf(data)
    if not on_this_machine or source.local:
        return
    from diloco.trainers import hub

    reason = "HF_HUB_OFFLINE=1 is set" if hub.offline() else hub.hub_unreachable()
    if reason is not None:
        raise ConfigError(f"data: {data!r} is not a local path and the Hugging Face Hub ({hub.endpoint()}) cannot be "
                          f"reached from this machine ({reason})",
                          hint="pass hf:<a save_to_disk directory or Parquet folder>, or pre-tokenized shards")


def _check_format(state: Mapping[str, Any], kind: str) -> None:
    if state.get("format") != POSITION_FORMATS[kind]:
        raise ValueError(f"data position {dict(state)} is not a {POSITION_FORMATS[kind]} position")


def _stack(blocks: list[Any]) -> torch.Tensor:
    import numpy as np
    import torch

    return torch.from_numpy(np.stack([np.asarray(b, dtype=np.int64) for b in blocks]))

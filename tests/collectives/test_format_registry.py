"""A wire format is one class in one module, registered by name: everything else reads it from the registry.

The proof is a toy format defined here and nowhere else (``Fp16``: fp16 with a pre-scale, one tensor per tensor):
registered, it is a valid ``store.compression`` with its own option (``store.compression_options``), its payloads
are tagged, checked, encoded and decoded by the same framing as the built-ins, it carries real all-reduce rounds
(gather and sharded, with error feedback) on a ``file://`` store, and a package can ship it through an entry point
so that a fresh process knows it. Nothing outside this file changed to get there. And no module outside
``diloco/formats`` branches on a format's name, so the next format needs no such line either.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save
from support.ranks import run_ranks  # tests/ is on sys.path

from diloco.collectives import compression
from diloco.collectives.allreduce import create_allreduce
from diloco.collectives.wire import PayloadCodec
from diloco.errors import ConfigError, CorruptObjectError
from diloco.formats import registry
from diloco.formats.base import Allocator, WireFormat, WireSpec
from diloco.store.settings import StoreSettings

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- the toy format: the whole diff of a new format
@dataclass(frozen=True)
class Fp16(WireFormat):
    """fp16 of ``x * scale`` (the scale keeps small pseudo-gradients out of fp16's subnormals), decoded as
    ``fp16 / scale``. Wire: ``<name>`` in fp16. Tag: ``scale``."""

    name = "fp16"
    summary = "half precision with a pre-scale (2x smaller)"

    scale: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or \
                not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"fp16 scale: {self.scale!r} is not a positive number; use 1 or a power of two")

    def wire_of(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> WireSpec:
        return {name: (tuple(shape), torch.float16)}

    def encode_tensor(self, name: str, tensor: torch.Tensor, empty: Allocator | None = None
                      ) -> dict[str, torch.Tensor]:
        return {name: (self.fp32(name, tensor) * self.scale).to(torch.float16)}

    def decode_tensor(self, wire: Mapping[str, torch.Tensor], name: str, out: torch.Tensor, mode: str) -> None:
        value = wire[name].reshape(-1).to(out.dtype) / self.scale
        if mode == "write":
            out.copy_(value)
        elif mode == "add":
            out.add_(value)
        else:
            out.sub_(value)


@pytest.fixture
def fp16() -> Iterator[type[Fp16]]:
    registry.register(Fp16)
    yield Fp16
    registry.unregister(Fp16.name)


def payload(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 33, generator=g) * 1e-3, "b": torch.randn(7, generator=g) * 1e-3}


# ---------------------------------------------------------------- settings
def test_a_registered_format_is_a_store_setting_with_its_own_options(fp16: type[Fp16]) -> None:
    settings = StoreSettings(compression="fp16", compression_options={"scale": 1024.0})
    assert compression.resolve("fp16") == Fp16()
    assert registry.from_settings(settings) == Fp16(scale=1024.0)
    assert PayloadCodec.from_settings(settings).format == Fp16(scale=1024.0)
    assert "fp16" in registry.names() and registry.names()[:5] == ("none", "bf16", "int8", "int4", "topk")
    with pytest.raises(ValueError, match=r"compression_options: fp16 scale: 0 is not a positive number"):
        StoreSettings(compression="fp16", compression_options={"scale": 0})
    with pytest.raises(ValueError, match=r"compression_options: bits is not an option of fp16 \(it takes scale\)"):
        StoreSettings(compression="fp16", compression_options={"bits": 8})
    with pytest.raises(ConfigError, match="store.compression_options: fp16 scale: -1"):
        create_allreduce(f"memory://{uuid.uuid4().hex}", 0, 2, compression="fp16",
                         compression_options={"scale": -1})


def test_an_unregistered_format_is_refused_naming_the_choices() -> None:
    assert "fp16" not in registry.names()
    with pytest.raises(ValueError, match=r"must be 'none', 'bf16', 'int8', 'int4' or 'topk' \(got 'fp16'\)"):
        StoreSettings(compression="fp16")
    with pytest.raises(ConfigError, match="store.compression: 'fp16' is not a compression format"):
        PayloadCodec("fp16")


def test_a_second_class_cannot_take_a_registered_name() -> None:
    @dataclass(frozen=True)
    class Impostor(Fp16):
        name = "int8"

    with pytest.raises(ValueError, match="wire format 'int8' is already diloco.formats.int8.Int8"):
        registry.register(Impostor)
    assert registry.get("int8").__module__ == "diloco.formats.int8"


# ---------------------------------------------------------------- the payload framing
def test_the_toy_round_trips_through_safetensors_with_its_tag(fp16: type[Fp16]) -> None:
    x = payload(0)
    fmt = Fp16(scale=1024.0)
    wire, meta = compression.encode(x, fmt)
    assert meta == {"compression": "fp16", "scale": "1024.0"}
    assert {n: (t.dtype, tuple(t.shape)) for n, t in wire.items()} == \
        {"w": (torch.float16, (40, 33)), "b": (torch.float16, (7,))}
    assert compression.wire_nbytes(compression.layout_of(x), fmt) == (40 * 33 + 7) * 2
    stored = load(save(wire, metadata=meta))
    out = compression.decode(stored, meta, compression.layout_of(x), fmt=fmt)
    for name in x:
        expected = (x[name] * 1024.0).to(torch.float16).to(torch.float32) / 1024.0
        assert torch.equal(out[name], expected), name
        assert torch.allclose(out[name], x[name], rtol=2**-10, atol=0)
    acc = {name: torch.ones_like(t) for name, t in x.items()}
    compression.decode_into(stored, meta, compression.layout_of(x), acc, mode="add", fmt=fmt)
    assert all(torch.equal(acc[name], 1 + out[name]) for name in x)


def test_a_toy_payload_of_other_parameters_or_a_lying_tag_is_corrupt(fp16: type[Fp16]) -> None:
    x = payload(1)
    layout = compression.layout_of(x)
    wire, meta = compression.encode(x, Fp16(scale=2.0))
    with pytest.raises(CorruptObjectError, match=r"\(fp16\) has scale 2.0, expected scale 1.0"):
        compression.decode(wire, meta, layout, fmt=Fp16())
    with pytest.raises(CorruptObjectError, match="'fp16', expected 'bf16'"):
        compression.decode(wire, meta, layout, fmt="bf16")
    with pytest.raises(CorruptObjectError, match=r"compressed payload \(fp16\) has \{'scale': 'big'\}"):
        compression.decode(wire, {**meta, "scale": "big"}, layout)
    bf16_wire, _ = compression.encode(x, "bf16")
    with pytest.raises(CorruptObjectError, match="wire tensor 'w' is torch.bfloat16"):
        compression.decode(bf16_wire, meta, layout)


def test_error_feedback_carries_what_the_toy_rounded_off(fp16: type[Fp16]) -> None:
    """The generic error feedback applies: the sum of what was sent tracks the sum of the inputs within one
    round's rounding, where without feedback the rounding of a value too small for fp16 is lost every round."""
    x = {"g": torch.full((64,), 1e-8)}  # below fp16's smallest subnormal (6e-8) at scale 1: rounds to 0
    with_feedback, without = compression.ErrorFeedback(Fp16()), compression.ErrorFeedback(Fp16(), enabled=False)
    sent = sum(with_feedback.compress(x)[2]["g"] for _ in range(20))
    lost = sum(without.compress(x)[2]["g"] for _ in range(20))
    assert float(lost.abs().max()) == 0.0
    assert torch.allclose(sent, torch.full((64,), 20e-8), rtol=0, atol=6e-8)


# ---------------------------------------------------------------- real rounds
@pytest.mark.parametrize("strategy", ["gather", "sharded"])
def test_the_toy_carries_real_rounds_with_identical_means_on_every_rank(fp16: type[Fp16], tmp_path: Path,
                                                                        strategy: str) -> None:
    world, rounds = 2, 2
    uri = f"file://{tmp_path}/rdv"

    def rank_fn(rank: int) -> list[dict[str, torch.Tensor]]:
        outs = []
        with create_allreduce(uri, rank, world, allreduce=strategy, compression="fp16",
                              compression_options={"scale": 256.0}, timeout_s=60, poll_interval_s=0.01) as ar:
            for k in range(rounds):
                tensors = payload(100 * rank + k)
                ar.allreduce(tensors)
                outs.append(tensors)
        return outs

    results = run_ranks(world, rank_fn, timeout=120)
    codecs = [PayloadCodec(Fp16(scale=256.0)) for _ in range(world)]  # each rank's sender, replayed
    for k in range(rounds):
        sent = [codecs[r].encode_contribution(("w", "b"), payload(100 * r + k))[2] for r in range(world)]
        for name in ("w", "b"):
            assert torch.equal(results[0][k][name].view(torch.uint8), results[1][k][name].view(torch.uint8))
            mean = sum(s[name] for s in sent) / world
            # gather averages the decoded contributions; sharded re-encodes each reduced shard once more
            tolerance = 0 if strategy == "gather" else float(mean.abs().max()) * 2**-10
            assert torch.allclose(results[0][k][name], mean, rtol=0, atol=tolerance + 1e-12), (k, name)


# ---------------------------------------------------------------- a format from another package
def test_a_package_ships_a_format_through_an_entry_point(tmp_path: Path) -> None:
    """A fresh process (a launcher, a replica) knows a format an installed package declares under the
    ``diloco.formats`` entry points, validates settings with it and encodes with it. A broken entry point is
    named when a run asks for it and breaks nothing else."""
    source = Path(__file__).read_text()
    toy = source[source.index("@dataclass(frozen=True)\nclass Fp16"):source.index("@pytest.fixture")]
    module = "\n".join(["from __future__ import annotations", "import math", "from collections.abc import Mapping",
                        "from dataclasses import dataclass", "import torch",
                        "from diloco.formats.base import Allocator, WireFormat, WireSpec", "", toy])
    (tmp_path / "toyformat.py").write_text(module)
    info = tmp_path / "toyformat-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyformat\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\nfp16 = toyformat:Fp16\n"
                                           "gone = toyformat_gone:Gone\n")
    script = textwrap.dedent("""
        import torch
        from diloco.collectives import compression
        from diloco.store.settings import StoreSettings
        settings = StoreSettings(compression="fp16", compression_options={"scale": 8.0})
        wire, meta = compression.encode({"x": torch.tensor([0.5, -0.25])}, "fp16")
        print(settings.compression, meta["compression"], wire["x"].dtype)
        try:
            StoreSettings(compression="gone")
        except ValueError as exc:
            print("gone:", "toyformat_gone:Gone, which cannot be loaded" in str(exc))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fp16", "fp16", "torch.float16", "gone:", "True"]


# ---------------------------------------------------------------- no name branches elsewhere
_NAME_BRANCH = re.compile(r"""\b(fmt|format|compression)\s*(==|!=|\bin\b|\bnot in\b)\s*[(\[]?\s*["'](none|bf16|int8|int4|topk)["']""")


def test_no_module_outside_the_formats_branches_on_a_format_name() -> None:
    assert _NAME_BRANCH.search('if codec_.fmt == "topk":') and _NAME_BRANCH.search("compression in ('int8', 'int4')")
    found = []
    for root in ("diloco", "executors", "cli"):
        for path in sorted((REPO / root).rglob("*.py")):
            if path.is_relative_to(REPO / "diloco" / "formats"):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if _NAME_BRANCH.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "branches on a format's name (ask the format: diloco.formats.registry):\n" + "\n".join(found)


def test_importing_the_store_settings_imports_neither_torch_nor_the_collectives() -> None:
    """Why the formats live outside the collectives: the store validates them and stays light."""
    script = ("import sys; import diloco.store.settings as s; s.StoreSettings(compression='topk'); "
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('diloco.collectives')))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

"""bench/scale_model.py: its byte counts are the formulas (and the real wire format's), its constants are the
code's, its tables have the rows README quotes, and ``--check`` reads a measured table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
from support.bench_scripts import load_bench_script

from diloco.collectives import compression
from diloco.store import codec, s3


def load_scale_model() -> ModuleType:
    return load_bench_script("scale_model")


sm = load_scale_model()


def test_constants_are_the_codes_own() -> None:
    assert sm.MULTIPART_CHUNKSIZE == s3.MULTIPART_CHUNKSIZE
    assert sm.MAX_PARTS == s3.MAX_PARTS
    assert sm.DEFAULT_BLOCK == compression.DEFAULT_BLOCK
    assert sm.HEADER_PROBE_BYTES == codec.HEADER_PROBE_BYTES
    assert sm.FORMATS == compression.FORMATS
    spec = compression.TopkSpec()
    assert (sm.TOPK_CHUNK, sm.TOPK_K, sm.TOPK_VALUE_BITS, sm.TOPK_LEVELS) == \
        (spec.chunk, spec.k, spec.value_bits, spec.levels)


@pytest.mark.parametrize("fmt", sm.FORMATS)
@pytest.mark.parametrize("params", [1, 255, 256, 4096, 1_000_003])
def test_payload_bytes_equal_the_compression_modules_wire_bytes(fmt: str, params: int) -> None:
    layout = {"w": ((params,), torch.float32)}
    assert sm.payload_bytes(params, fmt) == compression.wire_nbytes(layout, fmt)


@pytest.mark.parametrize("n", [2, 3, 8, 64, 256])
def test_gather_reads_n_minus_1_payloads_and_writes_one(n: int) -> None:
    cost = sm.round_cost("1.3B", 1.3e9, n, "gather", "none")
    s = int(1.3e9 * 4)
    assert cost.payload_bytes == s
    assert cost.bytes_written == s
    assert cost.bytes_read == (n - 1) * s


@pytest.mark.parametrize("fmt", [f for s, f in sm.SUPPORTED if s == "sharded"])
@pytest.mark.parametrize("n", [2, 3, 8, 64, 256])
def test_sharded_reads_2s_n_minus_1_over_n_plus_header_probes(fmt: str, n: int) -> None:
    cost = sm.round_cost("7B", 7e9, n, "sharded", fmt)
    s = sm.payload_bytes(7e9, fmt)
    shard = math.ceil(s / n)
    assert cost.bytes_written == s + shard
    assert cost.bytes_read == 2 * (n - 1) * shard + (n - 1) * sm.HEADER_PROBE_BYTES
    assert cost.bytes_read == pytest.approx(2 * s * (n - 1) / n, rel=1e-2)  # the 64 KiB probes: under 1% at 7B
    assert cost.limit_read == math.ceil(2 * s * (n - 1) / n)


def test_request_counts_follow_the_upload_path() -> None:
    part = sm.MULTIPART_CHUNKSIZE
    assert sm.upload_requests(part) == 1  # put_stream: one PUT up to one part
    assert sm.upload_requests(part + 1) == 2 + 2  # Create + 2 parts + Complete
    assert sm.upload_requests(2 * part - 1, single_put_max=sm.put_single_max(part)) == 1  # store.put: below 2 parts
    # 10,000 parts at most: a bigger object needs bigger parts, which the model assumes and flags
    huge = 600 * 2**30
    assert sm.too_many_parts(huge) and not sm.too_many_parts(400 * 2**30)
    assert sm.upload_requests(huge) == 2 + sm.MAX_PARTS
    small = sm.round_cost("50M", 50e6, 8, "gather", "int4")  # 25.8 MB: one PUT, 7 GETs, 7 HEADs
    assert (small.put_requests, small.get_requests, small.polls) == (1, 7, 7)
    sharded = sm.round_cost("50M", 50e6, 8, "sharded", "int4")  # 1 + 1 PUTs; 3 x 7 GETs; 2 x 7 HEADs
    assert (sharded.put_requests, sharded.get_requests, sharded.polls) == (2, 21, 14)
    # 64.5 MB: gather's store.put is still one PUT (below two parts), sharded's put_stream is multipart (2 parts)
    assert sm.round_cost("125M", 125e6, 8, "gather", "int4").put_requests == 1
    assert sm.round_cost("125M", 125e6, 8, "sharded", "int4").put_requests == (2 + 2) + 1


def test_dollars_are_the_requests_at_s3_prices() -> None:
    cost = sm.round_cost("7B", 7e9, 64, "sharded", "int8")
    expected = 64 * (cost.put_requests * 0.005 + (cost.get_requests + cost.polls) * 0.0004) / 1000
    assert cost.usd == pytest.approx(expected)


def test_more_prefixes_lift_the_request_bound_at_large_n() -> None:
    flat = sm.round_cost("125M", 125e6, 256, "sharded", "int8")
    spread = sm.round_cost("125M", 125e6, 256, "sharded", "int8", sm.Assumptions(prefixes=64))
    assert flat.request_bound
    assert spread.round_s < flat.round_s / 5
    assert not sm.round_cost("70B", 70e9, 8, "sharded", "int8").request_bound  # big shards: bandwidth-bound


def test_the_printed_tables_have_the_rows_readme_quotes(capsys: pytest.CaptureFixture[str]) -> None:
    assert sm.main(["--quick"]) == 0
    text = capsys.readouterr().out
    for title in ("Bytes read per rank per round", "Round time", "Dollars per round", "Committed-round upload"):
        assert f"### {title}" in text
    assert "| model | N | gather fp32 | sharded fp32 | sharded bf16 | sharded int8 | sharded int4 |" in text
    for model in ("125M", "1.3B", "7B", "70B"):
        for n in (2, 8, 64, 256):
            assert text.count(f"| {model} | {n} |") == 3  # one row in each of the three variant tables
    assert sm.PRICES_AS_OF in text


def test_json_holds_the_whole_grid(tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    assert sm.main(["--json", str(out)]) == 0
    grid = json.loads(out.read_text())
    assert {"title", "machine", "columns", "rows", "notes", "tables"} <= set(grid)  # bench/run_all.py's contract
    assert len(grid["rows"]) == 9 and grid["columns"] == list(grid["rows"][0])  # README's table
    assert [t["title"] for t in grid["tables"]][:2] == ["Bytes read per rank per round", "Round time"]
    assert len(grid["grid"]) == len(sm.MODEL_SIZES) * len(sm.WORLD_SIZES) * len(sm.SUPPORTED)


def traffic_row(store: str, n: int, strategy: str, fmt: str, elements: int, **overrides: float) -> dict[str, object]:
    """A row as bench/allreduce_traffic.py writes it (MiB rounded to 2 decimals), holding the model's counts."""
    c = sm.round_cost("m", elements, n, strategy, fmt)
    row: dict[str, object] = {
        "store": store, "N": n, "strategy": strategy, "compression": fmt,
        "S MiB": round(c.payload_bytes / 2**20, 2), "written MiB": round(c.bytes_written / 2**20, 2),
        "read MiB": round(c.bytes_read / 2**20, 2), "PUTs": c.put_requests, "GETs": c.get_requests,
        "polls": c.polls, "round s": 0.1}
    row.update(overrides)
    return row


def test_check_compares_a_measured_traffic_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    elements = 2 * 2**20  # 8 MiB of fp32, as --quick measures
    rows = [traffic_row("file", n, strategy, "none", elements) for n in (2, 4, 8) for strategy in sm.STRATEGIES]
    rows += [traffic_row("file", 4, strategy, fmt, elements) for strategy in sm.STRATEGIES for fmt in ("int8", "int4")]
    rows.append(traffic_row("s3", 4, "gather", "none", elements, polls=9.5, **{"read MiB": 25.0}))
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"title": "t", "machine": "m", "columns": [], "rows": rows, "notes": []}))
    capsys.readouterr()
    assert sm.main(["--check", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "| s3 | 4 | gather | fp32 | 8.00 / 8.00 (1.000) | 25.00 / 24.00 (1.042) | 1 / 1 | 3 / 3 | 9.5 / 3 |" \
        in printed
    assert "| file | 4 | sharded | int8 |" in printed
    assert "within 4.2% of every measured row" in printed
    assert f"exactly the model's in {len(rows)} of {len(rows)} rows" in printed
    # under make bench: the traffic table next to --json OUT is checked without --check
    results = tmp_path / "results"
    results.mkdir()
    (results / "allreduce_traffic.json").write_text(path.read_text())
    assert sm.main(["--quick", "--json", str(results / "scale_model.json")]) == 0
    written = json.loads((results / "scale_model.json").read_text())
    assert written["tables"][-1]["title"].startswith("Model vs measured: t (m)")
    assert len(written["tables"][-1]["rows"]) == len(rows)


def test_check_says_which_columns_it_needs() -> None:
    text = sm.check_report({"rows": [{"x": 1}]}, sm.Assumptions())
    assert "columns seen: ['x']" in text and "S MiB" in text


def test_the_readme_table_has_its_nine_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert sm.main(["--readme"]) == 0
    printed = capsys.readouterr().out
    for model in ("1.3B", "7B", "70B"):
        for n in (8, 64, 256):
            assert printed.count(f"| {model} | {n} |") == 1
    assert "Assumptions: 10 Gbit/s" in printed

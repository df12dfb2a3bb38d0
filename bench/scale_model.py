"""What a DiLoCo round over S3 would cost at scale: bytes, requests, seconds and dollars, from arithmetic alone.

Why: the benches measure N <= 8 and MiB-sized payloads on one machine; the question a user has is what N = 64
replicas of a 7B model cost per round, and whether gather, sharded or a compressed wire format is the one to pick.
This script answers with a model whose every term is stated here, and ``--check`` compares its byte and request
counts with a measured run (``bench/allreduce_traffic.py``'s JSON), so the model is only trusted where it was
checked. No I/O, no torch: it runs anywhere in well under a second.

    python bench/scale_model.py                       # markdown tables: a few N and model sizes
    python bench/scale_model.py --full --json out.json  # every N in 2..256 and model in 125M..70B
    python bench/scale_model.py --readme              # README's table: round time and dollars in one cell
    python bench/scale_model.py --check bench/results/allreduce_traffic.json
    python bench/scale_model.py --gbit 25 --prefixes 16   # other assumptions (see --help)

Under ``make bench`` (``bench/run_all.py`` passes ``--quick --json bench/results/scale_model.json``), the
``allreduce_traffic.json`` next to that output, when there is one, is checked too: the JSON's main table is README's
(round time and dollars), its ``tables`` the others and the check, its ``grid`` every configuration as numbers.

The model, per rank and per round (S = the wire payload: P parameters in the chosen format, scales included),
following diloco/collectives (gather.py, sharded.py):

* **gather**: write one object of S; read the N-1 peers' objects: reads (N-1)S, writes S.
* **sharded** (reduce-scatter, then all-gather): write one object of S; per peer read its header (one ranged GET
  of at most 64 KiB, ``codec.HEADER_PROBE_BYTES``) and the owned 1/N (one ranged GET); publish the reduced shard
  (compressed again in the wire format, as sharded.py does; ``--reduced none`` models fp32 shards); read the N-1
  other reduced shards. Reads 2S(N-1)/N plus the probes, writes S + S/N: the bandwidth-optimal read, under 2S
  whatever N is.
* **requests**: ``store.put`` (gather's object, the reduced shard) is one PUT below two parts, ``put_stream``
  (sharded's contribution) one PUT up to one part; above that CreateMultipartUpload + one UploadPart per part
  (``--part-mib``, 50 MiB as ``diloco/store/s3.py``'s ``MULTIPART_CHUNKSIZE``) + CompleteMultipartUpload. Every awaited
  peer object costs at least one look (``exists``; more when a peer is late: ``--polls``), one HEAD each, found or
  not (``diloco.store.s3.object_exists``: s3fs's own ``exists`` follows a 404 with a ListObjectsV2, billed at the
  PUT rate, 12.5 times a HEAD; diloco asks with the HEAD alone): with ``--polls P`` each object costs P HEADs.
  GETs: gather N-1, sharded 3(N-1). DELETEs (a rank deletes its previous round's objects) are free on S3 and not counted.
* **time**: each phase (upload, then the reads it waited for) takes the longer of its bytes at the instance's S3
  throughput and its requests at S3's per-prefix request rate (all N ranks hit the round's prefixes at once),
  plus one request latency, plus half a poll interval for each phase that waits for peers. Encoding, checksums
  and the fp32 mean are not included (they are CPU work that overlaps with the transfers in a streaming
  implementation); nor is the inner training the round overlaps with under Streaming DiLoCo.
* **dollars**: requests of all N ranks at S3 Standard prices. Traffic between EC2 and S3 in the same region is
  free; cross-region or internet transfer would add a per-GB charge that this model leaves out.

Separately (``commit`` table): after every committed round, one rank uploads the global state (fp32 weights and
outer momentum: 8P bytes, see ``diloco/replica/checkpoint.py``), which costs as much as a large all-reduce payload.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

MIB = 2**20
GB = 10**9

# S3 Standard, us-east-1, as listed on https://aws.amazon.com/s3/pricing/ (prices assumed as of 2026-11-30; they
# have been unchanged since 2018): PUT, COPY, POST, LIST $0.005 per 1,000 requests; GET, SELECT and all other
# requests (HEAD included) $0.0004 per 1,000; DELETE free. Multipart Create/UploadPart/Complete are PUT/POSTs.
PRICES_AS_OF = "2026-11-30"
PUT_USD_PER_1000 = 0.005
LIST_USD_PER_1000 = PUT_USD_PER_1000  # ListObjectsV2 is priced with PUT, COPY and POST
GET_USD_PER_1000 = 0.0004

# S3's documented request rate per partitioned prefix (https://docs.aws.amazon.com/AmazonS3/latest/userguide/
# optimizing-performance.html): at least 3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD requests per second.
PUT_RATE_PER_PREFIX = 3500.0
GET_RATE_PER_PREFIX = 5500.0

#: diloco/store/s3.py's MULTIPART_CHUNKSIZE (the part size of every multipart upload), duplicated to keep this script
#: free of imports; tests/test_scale_model.py checks they agree.
MULTIPART_CHUNKSIZE = 50 * MIB
#: S3's limit on the parts of one multipart upload (diloco/store/s3.py's MAX_PARTS).
MAX_PARTS = 10_000
#: diloco/store/codec.py's HEADER_PROBE_BYTES: the ranged GET that reads a streamed object's header.
HEADER_PROBE_BYTES = 64 * 2**10
#: diloco/collectives/compression.py's DEFAULT_BLOCK (elements per fp32 scale in int8/int4), checked the same way.
DEFAULT_BLOCK = 256
#: The sparse format's defaults (diloco/collectives/topk.py's TopkSpec): k of every chunk elements kept, each as a
#: packed code and an Elias-Fano position (low bits plus a bitmap per chunk), plus fp32 levels per chunk; checked
#: the same way.
TOPK_CHUNK, TOPK_K, TOPK_VALUE_BITS, TOPK_LEVELS = 4096, 102, 2, 2

STRATEGIES = ("gather", "sharded")
FORMATS = ("none", "bf16", "int8", "int4", "topk")
FORMAT_LABELS = {"none": "fp32", "bf16": "bf16", "int8": "int8", "int4": "int4", "topk": "topk"}
#: Strategy and format pairs the all-reduce offers: the sharded strategy re-encodes each reduced shard, which a
#: sparse format would drop most of, so topk goes with gather only.
SUPPORTED = tuple((s, f) for s in STRATEGIES for f in FORMATS if (s, f) != ("sharded", "topk"))

#: Model sizes (parameters) and world sizes of the full grid; the printed tables use the ``TABLE_*`` subsets.
MODEL_SIZES = {"125M": 125e6, "350M": 350e6, "1.3B": 1.3e9, "7B": 7e9, "13B": 13e9, "70B": 70e9}
WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128, 256)
TABLE_MODELS = ("125M", "1.3B", "7B", "70B")
TABLE_WORLDS = (2, 8, 64, 256)
#: The columns of the printed tables: (strategy, format) pairs.
TABLE_VARIANTS = (("gather", "none"), ("sharded", "none"), ("sharded", "bf16"), ("sharded", "int8"),
                  ("sharded", "int4"))


@dataclass(frozen=True)
class Assumptions:
    """Every knob of the model, with the default's reason next to it."""

    #: Sustained S3 throughput of one instance, in and out together. 10 Gbit/s: what one instance reaches with
    #: a few dozen parallel ranged GETs / multipart parts (AWS quotes ~100 MB/s per connection and up to 100
    #: Gbit/s for the largest instances); a conservative middle for the GPU instances a run uses.
    instance_bytes_per_s: float = 10e9 / 8
    #: Time to first byte of one S3 request (tens of ms for small objects, per AWS's performance guide).
    request_latency_s: float = 0.03
    #: ``store.poll_interval_s``: a rank notices a peer's object half an interval late on average. 1 s, between
    #: the built-in default (0.2 s) and what ``configs/sagemaker.yaml`` and ``configs/eks.yaml`` set (2 s).
    poll_interval_s: float = 1.0
    #: Looks (``exists``) per awaited object: 1 is the minimum (every peer already there when polled); each look
    #: beyond the one that finds the object is a miss, one HEAD as well.
    polls_per_object: float = 1.0
    part_bytes: int = MULTIPART_CHUNKSIZE
    block: int = DEFAULT_BLOCK
    #: How many S3 prefixes one round's objects are spread over (``store.spread``, see diloco/store/layout.py); each
    #: gets the per-prefix request rate once S3 has partitioned the bucket on them.
    prefixes: int = 1
    #: The format the sharded strategy publishes its reduced shards in: "same" as the wire, or "none" (fp32).
    reduced: str = "same"


@dataclass(frozen=True)
class Phase:
    """One step of a round, per rank: what it writes and reads, and whether it waits for peers first."""

    name: str
    bytes_written: int = 0
    bytes_read: int = 0
    put_requests: int = 0
    get_requests: int = 0  # GETs (whole or ranged)
    polls: int = 0  # looks while waiting for peers: one HEAD each, found or not (billed at the GET rate)
    waits_for_peers: bool = False


@dataclass(frozen=True)
class RoundCost:
    """One round of one configuration: per-rank traffic, the whole round's time and its dollars (all ranks)."""

    model: str
    params: float
    n: int
    strategy: str
    fmt: str
    payload_bytes: int  # S: one rank's contribution on the wire
    bytes_written: int  # per rank
    bytes_read: int  # per rank
    limit_read: int  # 2 S (N-1) / N: the bandwidth-optimal read for this payload
    put_requests: int  # per rank: PUT, multipart Create/UploadPart/Complete
    get_requests: int  # per rank: GETs, whole or ranged
    polls: int  # per rank: looks while waiting, a HEAD each (at least one per awaited object)
    round_s: float
    request_bound: bool  # S3's request rate, not bandwidth, sets over 10% of the round's time
    usd: float  # all N ranks
    phases: tuple[Phase, ...] = field(default=(), repr=False)

    @property
    def total_requests(self) -> int:
        """Per rank: PUT-class, GETs, and the polls' HEADs."""
        return self.put_requests + self.get_requests + self.polls


# ---------------------------------------------------------------- bytes and requests
def bytes_per_element(fmt: str, block: int = DEFAULT_BLOCK) -> float:
    """Wire bytes per fp32 parameter: fp32 4, bf16 2, int8 1 + 4/block, int4 1/2 + 4/block (fp32 scales), topk
    (Elias-Fano position bits / 8 + k value bits / 8 + 4 levels) / chunk."""
    if fmt == "topk":
        return (_position_bits(TOPK_CHUNK, TOPK_K) / 8 + TOPK_K * TOPK_VALUE_BITS / 8 + 4 * TOPK_LEVELS) / TOPK_CHUNK
    if fmt == "none":
        return 4.0
    if fmt == "bf16":
        return 2.0
    if fmt == "int8":
        return 1.0 + 4.0 / block
    if fmt == "int4":
        return 0.5 + 4.0 / block
    raise ValueError(f"format {fmt!r}: use one of {', '.join(FORMATS)}")


def _position_bits(width: int, kept: int) -> int:
    """Elias-Fano bits of one chunk's positions: ``low = floor(log2(width / kept))`` bits each, and a bitmap of
    ``kept + ((width - 1) >> low) + 1`` bits."""
    low = (width // kept).bit_length() - 1
    return kept * low + kept + ((width - 1) >> low) + 1


def _positions_bytes(chunks: int, width: int, kept: int) -> int:
    """Bytes of the positions of ``chunks`` chunks of one width: their low bits, then their bitmaps, each on a
    byte boundary."""
    if not chunks:
        return 0
    low = (width // kept).bit_length() - 1
    return -(-chunks * kept * low // 8) + -(-chunks * (_position_bits(width, kept) - kept * low) // 8)


def payload_bytes(params: float, fmt: str, block: int = DEFAULT_BLOCK) -> int:
    """S for one flat tensor of ``params`` elements (exact for int formats: the last block may be short)."""
    n = int(params)
    if fmt == "topk":
        full, tail = divmod(n, TOPK_CHUNK)
        tail_kept = max(1, -(-TOPK_K * tail // TOPK_CHUNK)) if tail else 0
        kept = full * TOPK_K + tail_kept
        chunks = full + (1 if tail else 0)
        positions = _positions_bytes(full, TOPK_CHUNK, TOPK_K) + (_positions_bytes(1, tail, tail_kept) if tail else 0)
        return positions + -(-kept * TOPK_VALUE_BITS // 8) + 4 * TOPK_LEVELS * chunks
    if fmt in ("int8", "int4"):
        codes = n if fmt == "int8" else -(-n // 2)
        return codes + 4 * -(-n // block)
    return int(n * bytes_per_element(fmt, block))


def upload_requests(size: int, part_bytes: int = MULTIPART_CHUNKSIZE, *, single_put_max: int | None = None) -> int:
    """PUT-class requests to upload ``size`` bytes: one PUT up to ``single_put_max`` (default one part), else
    CreateMultipartUpload + one UploadPart per part + CompleteMultipartUpload.

    ``ObjectStore.put`` sends one PUT below two parts (s3fs's threshold: ``put_single_max``), ``put_stream`` below
    one. Parts grow past ``part_bytes`` when S3's 10,000-part limit requires it (see ``too_many_parts``)."""
    limit = part_bytes if single_put_max is None else single_put_max
    if size <= limit:
        return 1
    return 2 + math.ceil(size / max(part_bytes, math.ceil(size / MAX_PARTS)))


def put_single_max(part_bytes: int) -> int:
    """The largest object ``ObjectStore.put`` sends as one PUT (s3fs: below ``2 * chunksize``)."""
    return 2 * part_bytes - 1


def too_many_parts(size: int, part_bytes: int = MULTIPART_CHUNKSIZE) -> bool:
    """Whether ``size`` needs more than S3's 10,000 parts at this part size (488 GiB at 50 MiB): diloco/store/s3.py
    refuses such an upload today ("more than 10000 parts"), so the model's larger parts are a needed change."""
    return math.ceil(size / part_bytes) > MAX_PARTS


def gather_phases(n: int, s: int, a: Assumptions) -> tuple[Phase, ...]:
    """``store.put`` of S; poll for and GET the N-1 peer objects: (N-1)S read (diloco/collectives/gather.py)."""
    peers = n - 1
    return (
        Phase("upload", bytes_written=s,
              put_requests=upload_requests(s, a.part_bytes, single_put_max=put_single_max(a.part_bytes))),
        Phase("read peers", bytes_read=peers * s, get_requests=peers, **_polls(peers, a), waits_for_peers=True),
    )


def sharded_phases(n: int, s: int, s_reduced: int, a: Assumptions) -> tuple[Phase, ...]:
    """As diloco/collectives/sharded.py does it: ``put_stream`` of S; per peer a header probe (one ranged GET of
    at most ``HEADER_PROBE_BYTES``) and one ranged GET of the owned shard; ``store.put`` of the reduced shard;
    one GET per other reduced shard."""
    peers = n - 1
    shard, reduced_shard = math.ceil(s / n), math.ceil(s_reduced / n)
    probe = min(HEADER_PROBE_BYTES, s)
    return (
        Phase("upload", bytes_written=s, put_requests=upload_requests(s, a.part_bytes)),
        Phase("reduce-scatter", bytes_read=peers * (probe + shard), get_requests=2 * peers, **_polls(peers, a),
              waits_for_peers=True),
        Phase("publish shard", bytes_written=reduced_shard,
              put_requests=upload_requests(reduced_shard, a.part_bytes, single_put_max=put_single_max(a.part_bytes))),
        Phase("all-gather", bytes_read=peers * reduced_shard, get_requests=peers, **_polls(peers, a),
              waits_for_peers=True),
    )


def _polls(peers: int, a: Assumptions) -> dict[str, int]:
    """The HEADs (one per look, found or not) of waiting for ``peers`` objects."""
    return {"polls": max(peers, math.ceil(peers * a.polls_per_object))}


def poll_usd(looks: int, found: int) -> float:
    """Dollars of ``looks`` polls of which ``found`` found their object: a HEAD each, whichever."""
    return usd_for(0, looks)


# ---------------------------------------------------------------- time and dollars
def phase_seconds(phase: Phase, n: int, a: Assumptions) -> tuple[float, float]:
    """(seconds, of which the request rate adds beyond the transfer) of one phase that all N ranks run at once."""
    transfer = (phase.bytes_written + phase.bytes_read) / a.instance_bytes_per_s
    by_puts = n * phase.put_requests / (PUT_RATE_PER_PREFIX * a.prefixes)
    by_gets = n * (phase.get_requests + phase.polls) / (GET_RATE_PER_PREFIX * a.prefixes)
    busiest = max(transfer, by_puts, by_gets)
    wait = a.poll_interval_s / 2 if phase.waits_for_peers else 0.0
    return busiest + a.request_latency_s + wait, busiest - transfer


def usd_for(put_requests: float, get_requests: float, lists: float = 0) -> float:
    """Dollars for that many PUT-class, GET-class (HEAD included) and LIST requests at S3 Standard prices."""
    return (put_requests * PUT_USD_PER_1000 + get_requests * GET_USD_PER_1000 + lists * LIST_USD_PER_1000) / 1000


def round_cost(model: str, params: float, n: int, strategy: str, fmt: str, a: Assumptions = Assumptions()
               ) -> RoundCost:
    """Everything the tables show for one configuration."""
    if n < 2:
        raise ValueError(f"world size {n}: a round needs at least 2 ranks")
    s = payload_bytes(params, fmt, a.block)
    if strategy == "gather":
        phases = gather_phases(n, s, a)
    elif strategy == "sharded":
        s_reduced = s if a.reduced == "same" else payload_bytes(params, a.reduced, a.block)
        phases = sharded_phases(n, s, s_reduced, a)
    else:
        raise ValueError(f"strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    timed = [phase_seconds(p, n, a) for p in phases]
    puts = sum(p.put_requests for p in phases)
    gets = sum(p.get_requests for p in phases)
    polls = sum(p.polls for p in phases)
    return RoundCost(
        model=model, params=params, n=n, strategy=strategy, fmt=fmt, payload_bytes=s,
        bytes_written=sum(p.bytes_written for p in phases), bytes_read=sum(p.bytes_read for p in phases),
        limit_read=math.ceil(2 * s * (n - 1) / n), put_requests=puts, get_requests=gets, polls=polls,
        round_s=sum(t for t, _ in timed), request_bound=sum(x for _, x in timed) > 0.1 * sum(t for t, _ in timed),
        usd=n * usd_for(puts, gets + polls), phases=phases,
    )


def commit_cost(params: float, n: int, a: Assumptions = Assumptions()) -> tuple[int, float, float]:
    """(bytes, seconds, dollars) of one committed round: one rank uploads fp32 weights + momentum (8P bytes) and
    a marker; every rank checks the marker once (a HEAD)."""
    size = int(8 * params)
    seconds = size / a.instance_bytes_per_s + a.request_latency_s
    return size, seconds, usd_for(upload_requests(size, a.part_bytes) + 1, n)


def grid(a: Assumptions = Assumptions(), models: Iterable[str] = MODEL_SIZES, worlds: Iterable[int] = WORLD_SIZES,
         variants: Iterable[tuple[str, str]] | None = None) -> list[RoundCost]:
    """Every (model, N, strategy, format) combination asked for."""
    chosen = list(variants) if variants is not None else list(SUPPORTED)
    return [round_cost(m, MODEL_SIZES[m], n, s, f, a) for m in models for n in worlds for s, f in chosen]


# ---------------------------------------------------------------- printing
def fmt_bytes(b: float) -> str:
    """Decimal units, 3 significant digits: 1.23 GB, 456 MB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b:.0f} B"


def fmt_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 60:
        return f"{s / 60:.3g} min"
    return f"{s:.3g} s"


def fmt_usd(usd: float) -> str:
    return f"${usd:.2g}" if usd < 1 else f"${usd:,.2f}"


def variant_label(strategy: str, fmt: str) -> str:
    return f"{strategy} {FORMAT_LABELS[fmt]}"


@dataclass(frozen=True)
class Table:
    """A titled table of strings: printed as markdown, written in the bench JSON format (rows as dicts)."""

    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    footnote: str = ""

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header) + " |", "|" + "|".join("---" for _ in self.header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return f"### {self.title}\n\n" + "\n".join(lines) + (f"\n\n{self.footnote}" if self.footnote else "")

    def as_json(self) -> dict[str, Any]:
        return {"title": self.title, "columns": list(self.header),
                "rows": [dict(zip(self.header, row, strict=True)) for row in self.rows]}


def variant_table(title: str, costs: Sequence[RoundCost], cell: Any, models: Sequence[str], worlds: Sequence[int],
                  variants: Sequence[tuple[str, str]] = TABLE_VARIANTS) -> Table:
    """Rows (model, N), one column per variant, ``cell(cost)`` in each."""
    index = {(c.model, c.n, c.strategy, c.fmt): c for c in costs}
    header = ("model", "N", *(variant_label(s, f) for s, f in variants))
    rows = tuple((m, str(n), *(cell(index[(m, n, s, f)]) for s, f in variants)) for m in models for n in worlds)
    return Table(title, header, rows)


def _time_cell(c: RoundCost) -> str:
    return fmt_seconds(c.round_s) + (" ‡" if c.request_bound else "")


REQUEST_BOUND_NOTE = "‡: S3's per-prefix request rate, not bandwidth, sets over 10% of the round's time."


def tables(a: Assumptions, models: Sequence[str] = TABLE_MODELS, worlds: Sequence[int] = TABLE_WORLDS
           ) -> list[Table]:
    """Bytes read, round time, dollars, and the committed-round upload, for these models and world sizes."""
    costs = grid(a, models, worlds, TABLE_VARIANTS)
    commits = Table(
        "Committed-round upload per round (one rank; fp32 weights + outer momentum)",
        ("model", "commit bytes", "commit s", "commit $ (N=64)"),
        tuple((m, fmt_bytes(b) + (" ⚠" if too_many_parts(b, a.part_bytes) else ""), fmt_seconds(t), fmt_usd(u))
              for m in models for b, t, u in [commit_cost(MODEL_SIZES[m], 64, a)]),
        footnote=f"⚠: more than {MAX_PARTS:,} parts of {a.part_bytes // MIB} MiB; diloco/store/s3.py refuses such an "
                 "upload today, the model assumes parts grown to fit.")
    return [
        variant_table("Bytes read per rank per round", costs, lambda c: fmt_bytes(c.bytes_read), models, worlds),
        replace(variant_table("Round time", costs, _time_cell, models, worlds), footnote=REQUEST_BOUND_NOTE),
        variant_table("Dollars per round, all ranks (requests per round)", costs,
                      lambda c: f"{fmt_usd(c.usd)} ({_count(c.n * c.total_requests)})", models, worlds),
        commits,
    ]


#: The README's table: fewer rows, time and dollars in one cell.
README_MODELS = ("1.3B", "7B", "70B")
README_WORLDS = (8, 64, 256)


def readme_table(a: Assumptions) -> Table:
    """One table for README: per (model, N) and variant, the round time and the dollars of all ranks' requests."""
    costs = grid(a, README_MODELS, README_WORLDS, TABLE_VARIANTS)
    table = variant_table("Round time · dollars per round (all ranks)", costs,
                          lambda c: f"{_time_cell(c)} · {fmt_usd(c.usd)}", README_MODELS, README_WORLDS)
    return replace(table, footnote=REQUEST_BOUND_NOTE)


def describe(a: Assumptions) -> str:
    return (
        f"Assumptions: {a.instance_bytes_per_s * 8 / 1e9:g} Gbit/s of S3 throughput per instance, "
        f"{a.request_latency_s * 1e3:g} ms per request, poll interval {a.poll_interval_s:g} s, "
        f"{a.polls_per_object:g} look(s) per awaited object (a HEAD each, found or not), "
        f"{a.part_bytes // MIB} MiB multipart parts, "
        f"int8/int4 scale block {a.block}, {a.prefixes} S3 prefix(es) per round at "
        f"{PUT_RATE_PER_PREFIX:,.0f} PUT/s and {GET_RATE_PER_PREFIX:,.0f} GET/s each, sharded reduced shards in "
        f"{'the wire format' if a.reduced == 'same' else FORMAT_LABELS[a.reduced]}; S3 Standard us-east-1 prices "
        f"as of {PRICES_AS_OF} (PUT and LIST ${PUT_USD_PER_1000}/1000, GET/HEAD ${GET_USD_PER_1000}/1000); "
        "encode/decode CPU time and same-region transfer (free) not included."
    )


def _count(n: float) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.3g}M req"
    if n >= 1e3:
        return f"{n / 1e3:.3g}k req"
    return f"{n:.0f} req"


# ---------------------------------------------------------------- check against a measured run
#: bench/allreduce_traffic.py's columns: per rank per round, means over ranks; sizes in MiB.
MEASURED_COLUMNS = ("store", "N", "strategy", "compression", "S MiB", "written MiB", "read MiB", "PUTs", "GETs",
                    "polls")


@dataclass(frozen=True)
class Comparison:
    """One measured row next to the model's prediction for the same store, N, strategy, format and payload."""

    store: str
    n: int
    strategy: str
    fmt: str
    measured: dict[str, float]  # written, read (bytes), puts, gets, polls
    model: dict[str, float]

    def ratio(self, quantity: str) -> float:
        want = self.model[quantity]
        return self.measured[quantity] / want if want else math.inf


def fp32_elements(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The payload's element count per store, from its uncompressed rows (S = 4 bytes per element there; the
    compressed rows' S MiB is rounded, so the fp32 one is the exact source)."""
    out: dict[str, int] = {}
    for row in rows:
        if row.get("compression", "none") == "none" and "S MiB" in row:
            out.setdefault(str(row.get("store", "")), round(float(row["S MiB"]) * MIB / 4))
    return out


def check_rows(measured: Mapping[str, Any], a: Assumptions) -> list[Comparison]:
    """Model vs measurement for every row of a bench/allreduce_traffic.py table (rows lacking a column are
    skipped). The measured payload's element count comes from the store's uncompressed rows, else from S."""
    rows = [r for r in measured.get("rows", []) if all(c in r for c in MEASURED_COLUMNS)]
    elements = fp32_elements(rows)
    out = []
    for row in rows:
        fmt = str(row["compression"])
        store = str(row["store"])
        params = elements.get(store) or round(float(row["S MiB"]) * MIB / bytes_per_element(fmt, a.block))
        c = round_cost("measured", params, int(row["N"]), str(row["strategy"]), fmt, a)
        out.append(Comparison(
            store=store, n=int(row["N"]), strategy=str(row["strategy"]), fmt=fmt,
            measured={"written": float(row["written MiB"]) * MIB, "read": float(row["read MiB"]) * MIB,
                      "puts": float(row["PUTs"]), "gets": float(row["GETs"]), "polls": float(row["polls"])},
            model={"written": c.bytes_written, "read": c.bytes_read, "puts": c.put_requests,
                   "gets": c.get_requests, "polls": c.polls}))
    return out


def check_table(measured: Mapping[str, Any], a: Assumptions) -> Table | None:
    """Measured / model (and their ratio) for bytes and requests per rank per round; ``None`` without rows."""
    comparisons = check_rows(measured, a)
    if not comparisons:
        return None
    rows = []
    for c in comparisons:
        cells = [c.store, str(c.n), c.strategy, FORMAT_LABELS.get(c.fmt, c.fmt)]
        for q in ("written", "read"):
            cells.append(f"{c.measured[q] / MIB:.2f} / {c.model[q] / MIB:.2f} ({c.ratio(q):.3f})")
        for q in ("puts", "gets", "polls"):
            cells.append(f"{c.measured[q]:g} / {c.model[q]:g}")
        rows.append(tuple(cells))
    worst_bytes = max(abs(c.ratio(q) - 1) for c in comparisons for q in ("written", "read"))
    exact_requests = sum(c.measured["puts"] == c.model["puts"] and c.measured["gets"] == c.model["gets"]
                         for c in comparisons)
    return Table(
        f"Model vs measured: {measured.get('title', 'a measured run')} ({measured.get('machine', 'unknown machine')})",
        ("store", "N", "strategy", "format", "written MiB", "read MiB", "PUTs", "GETs", "polls"), tuple(rows),
        footnote=(
            "Each cell: measured / model per rank per round (bytes in MiB, with measured ÷ model). Polls: the model "
            "counts the minimum, one HEAD per awaited object; more measured is waiting for peers (timing-dependent). "
            f"Bytes: the model is within {worst_bytes:.1%} of every measured row (the rest is safetensors headers "
            f"and the MiB rounding of the measured table). PUTs and GETs: exactly the model's in {exact_requests} "
            f"of {len(comparisons)} rows."))


def check_report(measured: Mapping[str, Any], a: Assumptions) -> str:
    """``check_table`` as markdown, or which columns were missing."""
    table = check_table(measured, a)
    if table is None:
        seen = sorted({str(k) for r in measured.get("rows", []) for k in r})
        return (f"no measured row has the columns {', '.join(MEASURED_COLUMNS)} (bench/allreduce_traffic.py's); "
                f"columns seen: {seen}")
    return table.markdown()


# ---------------------------------------------------------------- command line
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="OUT", help="also write every row of the grid (all N, all models) as JSON")
    p.add_argument("--check", metavar="MEASURED.json", help="compare with bench/allreduce_traffic.py's JSON")
    p.add_argument("--quick", action="store_true", help="the default tables (make bench passes it; no effect)")
    p.add_argument("--full", action="store_true", help="print every N in 2..256 and every model size")
    p.add_argument("--readme", action="store_true", help="print only README's table (round time · dollars)")
    p.add_argument("--gbit", type=float, default=10.0, help="S3 throughput per instance, Gbit/s (default 10)")
    p.add_argument("--latency-ms", type=float, default=30.0, help="latency per request (default 30 ms)")
    p.add_argument("--poll-s", type=float, default=1.0, help="store.poll_interval_s (default 1)")
    p.add_argument("--polls", type=float, default=1.0, help="looks per awaited object (default 1, the minimum; "
                   "each look a HEAD, found or not)")
    p.add_argument("--part-mib", type=int, default=MULTIPART_CHUNKSIZE // MIB, help="multipart part size, MiB")
    p.add_argument("--block", type=int, default=DEFAULT_BLOCK, help="int8/int4 elements per scale (default 256)")
    p.add_argument("--prefixes", type=int, default=1, help="S3 prefixes a round's objects are spread over (store.spread; default 1)")
    p.add_argument("--reduced", choices=("same", "none"), default="same",
                   help="format of sharded's reduced shards: the wire format (same) or fp32 (none)")
    args = p.parse_args(argv)
    for name in ("gbit", "part_mib", "block", "prefixes"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def assumptions_from(args: argparse.Namespace) -> Assumptions:
    return Assumptions(instance_bytes_per_s=args.gbit * 1e9 / 8, request_latency_s=args.latency_ms / 1e3,
                       poll_interval_s=args.poll_s, polls_per_object=args.polls, part_bytes=args.part_mib * MIB,
                       block=args.block, prefixes=args.prefixes, reduced=args.reduced)


TITLE = "Scale model: one DiLoCo round over S3 (computed, not measured)"


def find_measured(args: argparse.Namespace) -> str | None:
    """``--check``'s file, else (under ``make bench``) ``allreduce_traffic.json`` next to ``--json OUT``, which
    bench/run_all.py writes into the same results folder."""
    if args.check:
        return str(args.check)
    if args.json:
        sibling = Path(args.json).resolve().parent / "allreduce_traffic.json"
        if sibling.exists():
            return str(sibling)
    return None


def to_json(a: Assumptions, shown: list[Table], check: Table | None) -> dict[str, Any]:
    """The bench JSON format (bench/run_all.py): README's table as the main one, the others as ``tables``, and
    every row of the full grid (all N, all models, all variants) as numbers under ``grid``."""
    main_table = readme_table(a)
    extra = [t.as_json() for t in shown] + ([check.as_json()] if check else [])
    notes = [describe(a), REQUEST_BOUND_NOTE] + [t.footnote for t in shown if t.footnote and t.footnote !=
                                                  REQUEST_BOUND_NOTE]
    if check:
        notes.append(check.footnote)
    grid_rows = []
    for c in grid(a):
        row = asdict(replace(c, phases=()))
        row.pop("phases")
        grid_rows.append(row)
    return {"title": TITLE, "machine": "computed (arithmetic, no machine)", "columns": list(main_table.header),
            "rows": main_table.as_json()["rows"], "tables": extra, "notes": notes, "grid": grid_rows}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    a = assumptions_from(args)
    shown = tables(a, tuple(MODEL_SIZES), WORLD_SIZES) if args.full else tables(a)
    measured_path = find_measured(args)
    check = None
    if measured_path:
        with open(measured_path) as f:
            measured = json.load(f)
        check = check_table(measured, a)
        if check is None:
            print(check_report(measured, a), file=sys.stderr)
    if args.readme:
        print(readme_table(a).markdown() + "\n\n" + describe(a))
    else:
        print("\n\n".join([f"## {TITLE}", describe(a), *(t.markdown() for t in shown)]))
        if check:
            print("\n" + check.markdown())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(a, shown, check), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where things live in a run's rendezvous store: one place, shared by the replicas and the orchestrator.

    round_NNNNNN/rank_RRRR.safetensors   each rank's contribution to one all-reduce round (see diloco.collectives.allreduce);
                                         NNNNNN is the round's zero-based index: round 1 is round_000000
    round_NNNNNN/manifest.json           with min_replicas, and every round of an elastic run: the ranks whose
                                         contributions that round averages (and, elastic, the next round's
                                         members), created exactly once (diloco.collectives.gather)
    membership.json                      an elastic run's target membership, written by `diloco scale` and copied
                                         into the next manifest (diloco.collectives.membership)
    round_NNNNNN/shard_SSSS.safetensors  sharded all-reduce only: the mean of shard SSSS of that round, published by
                                         its owner (rank SSSS) for the others to read (diloco.collectives.sharded)
    round_NNNNNN/rank_RRRR/part_PPPP.safetensors
                                         a replica whose model is sharded over its local processes (FSDP2): local
                                         process PPPP's rows of rank RRRR's contribution (diloco.collectives.parts)
    metrics/rank_RRRR.jsonl              each rank's history: init, one row per outer round, final (diloco.replica.metrics)
    progress/rank_RRRR.json              each rank's latest progress row, overwritten every few seconds
    final/rank_RRRR.safetensors          each rank's final global weights (identical across ranks)
    final/compacted.json                 after collect found every copy identical: the one copy kept and its hash
    committed/round_NNNNNN/{state.safetensors,COMMITTED}
                                         the global state after round NNNNNN (from 1), marker last (diloco.replica.checkpoint)
    committed/round_NNNNNN/parts_KKKK/part_PPPP.safetensors
                                         the same state written by a replica of KKKK local processes, one part per
                                         process, the marker naming KKKK (diloco.replica.checkpoint_parts)
    relaunch/rank_RRRR.json              a relaunch of rank RRRR in progress: peers extend their wait (launcher)
    rejoin/rank_RRRR.json                rank RRRR rejoined the run for one round: peers owe it that round's time
    logs/rank_RRRR/<attempt>/chunk_NNNNNN.json, end.json
                                         a replica's own output and exit code, where a backend asks the replicas
                                         to ship them (diloco.store.logs): it outlives the pods
    run.json                             the launcher's record of the run (id and resolved config)
    spec.json                            the replicas' settings (``diloco.replica.settings``), written by the
                                         launcher before any replica starts and read by each (``--spec``)
    sagemaker/{code,output,checkpoints}/ the SageMaker backend's code channel, job outputs and spot checkpoints

Request layout of the all-reduce (``spread``). S3 serves a few thousand GETs (5,500/s) and PUTs (3,500/s) per
second *per prefix*; at large N a round's GETs hit that limit before its bytes hit the bandwidth (the sharded
all-reduce makes about 3N(N-1) GETs per round, 48,000 at N = 128). With ``spread = P > 1`` the round keys of rank
or shard ``i`` move under ``p{i mod P}/``:

    p{K}/round_NNNNNN/rank_RRRR.safetensors    K = RRRR mod P
    p{K}/round_NNNNNN/shard_SSSS.safetensors   K = SSSS mod P

so a round's requests are split evenly over P prefixes that S3 can partition independently (``i mod P`` is the
perfect hash for consecutive integers; S3 partitions on the leading characters, which is why the spread prefix
comes first). ``spread = 1`` (the default) is the flat layout above, so ``contribution_key(round, rank)`` keeps
naming every contribution of a run that does not spread. Every rank must use the same ``spread``.
"""

METRICS_KEY = "metrics/rank_{rank:04d}.jsonl"
PROGRESS_KEY = "progress/rank_{rank:04d}.json"
FINAL_KEY = "final/rank_{rank:04d}.safetensors"
RUN_INFO_KEY = "run.json"
SPEC_KEY = "spec.json"
LOGS_PREFIX = "logs"

# Committed rounds (diloco.replica.checkpoint): the global state after round N (numbered from 1), data then marker.
COMMITTED_PREFIX = "committed/"
COMMITTED_DATA_KEY = "committed/round_{round:06d}/state.safetensors"
COMMITTED_MARKER_KEY = "committed/round_{round:06d}/COMMITTED"
# Relaunches in progress (written by the launcher, read by peers' all-reduce to extend their wait).
RELAUNCH_KEY = "relaunch/rank_{rank:04d}.json"
# A restarted rank's rejoin (written by it, read by peers' all-reduce: the round it contributes to next, and when).
REJOIN_KEY = "rejoin/rank_{rank:04d}.json"
# A rank the launcher left behind (failed for good in a --min-replicas run; written by the launcher, read by peers'
# all-reduce: a round commits without it at once instead of waiting out its deadline). Removed if it is relaunched.
LEFT_KEY = "left/rank_{rank:04d}.json"

# All-reduce rounds (diloco.collectives): a rank's contribution and, sharded, the mean of one shard.
CONTRIBUTION_KEY = "round_{round:06d}/rank_{rank:04d}.safetensors"
REDUCED_SHARD_KEY = "round_{round:06d}/shard_{shard:04d}.safetensors"
#: A sharded replica's contribution: one object per local process (part), under the replica's own prefix.
PART_PREFIX = "round_{round:06d}/rank_{rank:04d}/"
PART_KEY = PART_PREFIX + "part_{part:04d}.safetensors"
#: A committed round written by a replica of ``parts`` local processes, one object per part.
COMMITTED_PART_KEY = "committed/round_{round:06d}/parts_{parts:04d}/part_{part:04d}.safetensors"
#: Partial participation (min_replicas): the round's member set, created exactly once (never spread: one per round).
ROUND_MANIFEST_KEY = "round_{round:06d}/manifest.json"
#: An elastic run's target membership (diloco.collectives.membership), written by the launcher's scale.
MEMBERSHIP_KEY = "membership.json"
#: The most prefixes a round may be spread over (S3 partitions far fewer in practice; more only adds listings).
MAX_SPREAD = 4096


def spread_prefix(index: int, spread: int) -> str:
    """The prefix (``""`` or ``"p{K}/"``) of rank or shard ``index``'s round keys when spread over ``spread``."""
    return "" if spread == 1 else f"p{index % spread}/"


def contribution_key(round_: int, rank: int, spread: int = 1) -> str:
    """Where ``rank`` publishes its contribution to the round of zero-based index ``round_``."""
    return spread_prefix(rank, spread) + CONTRIBUTION_KEY.format(round=round_, rank=rank)


def reduced_shard_key(round_: int, shard: int, spread: int = 1) -> str:
    """Where the owner of ``shard`` publishes that shard's mean for the round of zero-based index ``round_``."""
    return spread_prefix(shard, spread) + REDUCED_SHARD_KEY.format(round=round_, shard=shard)


def part_key(round_: int, rank: int, part: int, spread: int = 1) -> str:
    """Where local process ``part`` of replica ``rank`` publishes its rows of the replica's contribution."""
    return spread_prefix(rank, spread) + PART_KEY.format(round=round_, rank=rank, part=part)


def part_prefix(round_: int, rank: int, spread: int = 1) -> str:
    """The prefix holding every part of replica ``rank``'s contribution to a round."""
    return spread_prefix(rank, spread) + PART_PREFIX.format(round=round_, rank=rank)


def check_spread(spread: object) -> int:
    """``spread`` as an int, or a ``ConfigError`` naming the field and the allowed range."""
    from diloco.errors import ConfigError

    if isinstance(spread, bool) or not isinstance(spread, int) or not 1 <= spread <= MAX_SPREAD:
        raise ConfigError(f"store.spread must be an integer in [1, {MAX_SPREAD}], got {spread!r}",
                          hint="1 keeps every round under one prefix; use about N/8 prefixes for N replicas on S3")
    return spread

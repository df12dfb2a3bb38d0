"""The store settings: how the replicas exchange a round through the store and how patiently they wait for each
other, declared once.

They are the run config's ``store:`` section (``diloco.launcher.config.StoreConfig`` adds the rendezvous template
to them) and part of every replica's settings (``diloco.replica.settings.ReplicaSettings`` extends them), and the
collectives are built from them (``diloco.collectives.allreduce.create_allreduce``). So a new store setting is one
new field here: the YAML config, ``diloco launch``'s flag (``cli_flag``), the generated configuration reference,
the published settings object and the replica entrypoint's flag (``replica_flag``) all follow from it, and its
rules are written once, in this model.

A data model only (pydantic and the shared basics), light enough for the CLI's start-up.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from diloco.defaults import DEFAULT_POLL_INTERVAL_S
from diloco.flags import cli_flag, replica_flag
from diloco.formats import registry
from diloco.topk_params import TopkParams

#: The sparse format's defaults, declared once with its rules (``diloco.topk_params``).
_SPARSE = TopkParams()

#: A wire format's name: any registered format (``diloco.formats.registry``), checked when the settings are made,
#: so a format registered by a plugin or a test is accepted like a built-in one.
FormatName = Annotated[str, AfterValidator(registry.check_name)]


def min_replicas_problem(min_replicas: int | None, world_size: int) -> str | None:
    """What is wrong with ``min_replicas`` for a run of ``world_size`` replicas, or None: the one place the rule
    is written (the run config says it about ``store.min_replicas``, the replica about its own setting)."""
    if min_replicas is not None and min_replicas > world_size:
        return f"must be at most the number of replicas ({world_size}) (got {min_replicas})"
    return None


class StoreSettings(BaseModel):
    """How the replicas exchange a round through the store and how patiently they wait for each other: the run
    config's ``store:`` section (without its rendezvous template) and part of every replica's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(1800.0, gt=0, description="How long a replica waits for its peers in one round, "
                             "seconds.", json_schema_extra=replica_flag("--timeout", metavar="S"))
    poll_interval_s: float = Field(
        DEFAULT_POLL_INTERVAL_S, gt=0, description="How often a waiting replica looks for its peers' uploads, "
        "seconds (its cost and latency: diloco.defaults).",
        json_schema_extra=replica_flag("--poll-interval", metavar="S"))
    allreduce: Literal["gather", "sharded"] = Field(
        "gather", description="How rounds are averaged: gather (every rank reads every peer's object, (N-1)*S "
        "bytes) or sharded (reduce-scatter + all-gather through the store, under 2*S bytes).",
        json_schema_extra={**cli_flag("--allreduce", metavar="STRATEGY"), **replica_flag(metavar="STRATEGY")})
    compression: FormatName = Field(
        "none", description="Pseudo-gradient wire format: none, bf16, int8, int4 (fp32 accumulation after decode, "
        "per-block scales for the integers) or topk (SparseLoCo's sparse format: the largest topk_density of "
        "every topk_chunk elements, topk_value_bits each; gather only), or a registered format "
        "(docs/extending.md).",
        json_schema_extra={"enum": list(registry.names()), **cli_flag("--compression", metavar="FORMAT"),
                           **replica_flag(metavar="FORMAT")})
    compression_options: dict[str, Any] = Field(
        default_factory=dict, description="Parameters of the compression format, by name (int8/int4: block; a "
        "registered format's own; topk's are topk_density, topk_chunk and topk_value_bits).",
        json_schema_extra=replica_flag("--compression-options-json", metavar="JSON"))
    error_feedback: bool = Field(True, description="Keep what a lossy format dropped and add it to the next "
                                 "round's contribution.")
    error_feedback_decay: float = Field(1.0, gt=0, le=1, description="What is kept of the residual each round "
                                        "before it is added (SparseLoCo's beta; 1: plain error feedback).",
                                        json_schema_extra=replica_flag(metavar="BETA"))
    topk_density: float = Field(_SPARSE.density, gt=0, le=1, description="topk: the fraction of each chunk's elements sent "
                                "(SparseLoCo: 1-3%; 2.5% matched fp32 DiLoCo's loss on the convergence bench).",
                                json_schema_extra=replica_flag(metavar="FRACTION"))
    topk_chunk: int = Field(_SPARSE.chunk, ge=2, le=65536, description="topk: elements per chunk, each chunk keeping its "
                            "own largest.", json_schema_extra=replica_flag(metavar="N"))
    topk_value_bits: int = Field(_SPARSE.value_bits, ge=1, le=8, description="topk: bits per kept value (a sign, the rest a "
                                 "magnitude level).", json_schema_extra=replica_flag(metavar="BITS"))
    spread: int = Field(1, ge=1, le=4096, description="Spread a round's keys over this many prefixes (at large "
                        "N, S3's per-prefix request rate limits a round first: diloco.store.layout).",
                        json_schema_extra=replica_flag(metavar="P"))
    min_replicas: int | None = Field(
        None, ge=1, description="Commit a round whose deadline passed with at least K contributions (null: "
        "every round needs every replica).",
        json_schema_extra={**cli_flag("--min-replicas", metavar="K", note="store.min_replicas; default: every "
                                      "round needs every replica"), **replica_flag(metavar="K")})

    max_replicas: int | None = Field(
        None, ge=1, description="Make the run elastic: diloco scale may grow it up to K replicas (or shrink it); "
        "every round then commits a manifest naming its members and the next round's (null: a fixed set of "
        "replicas).",
        json_schema_extra={**cli_flag("--max-replicas", metavar="K", note="store.max_replicas; default: the run "
                                      "cannot be scaled"), **replica_flag(metavar="K")})

    keep_rounds: int = Field(3, ge=1, description="Committed rounds kept in the store (each one the global state "
                             "a relaunched replica rejoins from); older ones are deleted as new ones commit.",
                             json_schema_extra=replica_flag(metavar="K"))

    @model_validator(mode="after")
    def _strategy_fits(self) -> StoreSettings:
        if self.min_replicas is not None and self.allreduce == "sharded":
            raise ValueError("min_replicas: partial participation needs allreduce gather (a sharded round cannot "
                             "go on without a member: its shard would be missing); drop one of the two")
        if self.max_replicas is not None and self.allreduce == "sharded":
            raise ValueError("max_replicas: an elastic run needs allreduce gather (a sharded round's shards are "
                             "owned by a fixed set of ranks); drop one of the two")
        if self.max_replicas is not None and self.min_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas: must be at most max_replicas ({self.max_replicas}) (got "
                             f"{self.min_replicas})")
        problem = registry.settings_problem(self)  # the format's own rules, written once, in its module
        if problem:
            raise ValueError(problem)
        return self



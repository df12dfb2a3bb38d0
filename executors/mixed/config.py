"""The ``backend:`` section of a run split over backends: its parts, each a backend's own section with a replica
count, validated by that backend's own model.

The shape a user writes (YAML), and its command-line form (``--part KIND[:N]``, repeatable)::

    replicas: 4
    backend:
      kind: mixed
      parts:
        - {kind: eks, replicas: 2, namespace: ml, service_account: diloco}
        - {kind: sagemaker, replicas: 1, role_arn: arn:aws:iam::123456789012:role/diloco, use_spot: true}
        - {kind: local}        # no count: the replicas the others leave (here 1)

Ranks are global and assigned to the parts in order, contiguously (above: eks 0-1, sagemaker 2, local 3). At most
one part leaves its count out; when every part has one, their sum is the run's ``replicas``. An error names the
field as ``backend.parts[1].role_arn``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializeAsAny,
    model_serializer,
    model_validator,
)

from diloco.config_errors import short
from diloco.errors import ConfigError
from diloco.executors.base import BackendConfig
from diloco.executors.flags import cli_flag

#: The composite backend's registered name.
MIXED = "mixed"

__all__ = ["MIXED", "MixedBackendConfig", "MixedPart", "parse_part"]


class MixedPart(BaseModel):
    """One part of the run: ``replicas`` of its replicas on one backend, with that backend's own ``config``.

    Written (and dumped) flat: the backend section's keys with ``replicas`` beside them."""

    model_config = ConfigDict(extra="forbid")

    replicas: int | None = Field(None, ge=1)  # None: what the other parts leave of the run's replicas
    config: SerializeAsAny[BackendConfig]

    @property
    def kind(self) -> str:
        return self.config.kind

    @model_serializer(mode="plain")
    def _flat(self, info: SerializationInfo) -> dict[str, Any]:
        """``{"kind": ..., "replicas": N, <the backend's fields>}``: what a user writes, so a run record's config
        validates again into the same part."""
        out: dict[str, Any] = {"kind": self.config.kind}
        if self.replicas is not None:
            out["replicas"] = self.replicas
        out.update(self.config.model_dump(mode=info.mode, exclude={"kind"}))
        return out


def parse_part(item: Any, where: str) -> dict[str, Any]:
    """A part as written: ``"eks:2"`` or ``"local"`` (the command line's form), or a mapping; as a mapping with
    its ``kind`` and, when given, ``replicas``. ``ValueError`` naming ``where`` for anything else."""
    if isinstance(item, str):
        kind, sep, count = item.strip().partition(":")
        if not kind or (sep and not count.strip().isdigit()) or (sep and int(count) < 1):
            raise ValueError(f"{where}: expected KIND or KIND:N such as eks:2 (got {item!r})")
        return {"kind": kind.strip(), **({"replicas": int(count)} if sep else {})}
    if isinstance(item, Mapping):
        return dict(item)
    raise ValueError(f"{where}: must be a backend section with its replicas, or KIND:N (got {short(item)})")


class MixedBackendConfig(BackendConfig):
    """One run over several backends at once: its parts, in rank order, each a backend's own section with its
    replicas (docs/backends/mixed.md)."""

    kind: Literal["mixed"] = MIXED
    parts: list[MixedPart] = Field(
        description="A part of the run: a backend and how many replicas it runs, e.g. eks:2 (repeat for each "
                    "part, in rank order; one part may leave N out to take the rest). The other backend flags "
                    "go to every part whose backend takes them.",
        json_schema_extra=cli_flag("--part", metavar="KIND[:N]", multiple=True, note="backend.parts"))

    #: What a run split over backends can at most meet in when nothing else is known of it (its ``doctor``
    #: context): S3. Its parts decide for a real run (``rendezvous_problem``).
    rendezvous_schemes: ClassVar[tuple[str, ...]] = ("s3",)
    places_replicas: ClassVar[bool] = True

    @model_validator(mode="before")
    @classmethod
    def _validate_parts(cls, data: Any) -> Any:
        """Each part validated by its own backend's model, its errors named ``backend.parts[i].<field>``."""
        if not isinstance(data, Mapping) or "parts" not in data:
            return data
        raw = data["parts"]
        if not isinstance(raw, (list, tuple)):
            raise ValueError(f"backend.parts: must be a list of parts, each a backend section with its replicas "
                             f"(got {short(raw)})")
        if len(raw) < 2:
            raise ValueError(f"backend.parts: a run split over backends needs at least two parts (got {len(raw)}); "
                             f"for one backend, use --backend KIND")
        parts: list[MixedPart] = []
        uncounted: int | None = None
        for i, item in enumerate(raw):
            where = f"backend.parts[{i}]"
            part = item if isinstance(item, MixedPart) else _validated_part(item, where)
            if part.replicas is None:
                if uncounted is not None:
                    raise ValueError(f"{where}.replicas: only one part may leave its replica count out (it takes "
                                     f"what the others leave); backend.parts[{uncounted}] does already")
                uncounted = i
            parts.append(part)
        return {**data, "parts": parts}

    # ---------------------------------------------------------------- the run's shape
    def fixed_replicas(self) -> int | None:
        """The sum of the parts' counts, when every part has one."""
        counts = [p.replicas for p in self.parts]
        return None if None in counts else sum(c for c in counts if c is not None)

    def replicas_problem(self, replicas: int) -> str | None:
        counted = sum(p.replicas or 0 for p in self.parts)
        open_part = next((i for i, p in enumerate(self.parts) if p.replicas is None), None)
        if open_part is None and counted != replicas:
            return (f"replicas: the parts of this run (backend.parts) run {counted} replica(s), not {replicas}; "
                    f"leave --replicas out, or make the parts' counts add up to it")
        if open_part is not None and counted >= replicas:
            return (f"replicas: the parts with a count (backend.parts) already run {counted} of the run's {replicas} "
                    f"replica(s), which leaves none for backend.parts[{open_part}] "
                    f"({self.parts[open_part].kind}); raise --replicas or lower a count")
        return None

    def part_ranks(self, replicas: int) -> list[list[int]]:
        """Each part's global ranks, in order and contiguous; ``ConfigError`` when the counts do not fit."""
        problem = self.replicas_problem(replicas)
        if problem:
            raise ConfigError(problem)
        rest = replicas - sum(p.replicas or 0 for p in self.parts)
        out, first = [], 0
        for part in self.parts:
            count = part.replicas if part.replicas is not None else rest
            out.append(list(range(first, first + count)))
            first += count
        return out

    # ---------------------------------------------------------------- what its parts share
    def rendezvous_problem(self, scheme: str) -> str | None:
        """A store every part's replicas reach: a ``file://`` one only when no part leaves this machine."""
        for i, part in enumerate(self.parts):
            if part.config.rendezvous_problem(scheme):
                schemes = " or ".join(f"{s}://" for s in part.config.rendezvous_schemes)
                return (f"every part of a run split over backends meets in it, and backend.parts[{i}] "
                        f"({part.kind}) runs replicas that need an {schemes} URI")
        return None

    def places_some_replicas(self) -> bool:
        return any(part.config.places_some_replicas() for part in self.parts)

    def default_rendezvous(self, run_id: str) -> str | None:
        """The parts' own default, when they all have the same one (parts on this machine: its run directory)."""
        defaults = {part.config.default_rendezvous(run_id) for part in self.parts}
        return defaults.pop() if len(defaults) == 1 else None

    def default_check_trainer_locally(self) -> bool:
        """A part whose replicas import the trainer from this interpreter (a local part) needs it importable here."""
        return any(part.config.default_check_trainer_locally() for part in self.parts)

    # ---------------------------------------------------------------- the command line
    @classmethod
    def apply_flags(cls, kind: str, section: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
        """``--part`` sets the parts (replacing the config file's); every other backend flag goes to each part
        whose backend declares it (``--image`` to the eks and the sagemaker parts alike), and one that no part
        takes is a ``ConfigError`` naming the parts."""
        from diloco.executors import backend_names, config_type

        given = {k: v for k, v in given.items() if v is not None}
        own = {k: v for k, v in given.items() if k in cls.flags}
        out = dict(section)
        if "part" in own:
            out["parts"] = list(own["part"])
        raw = out.get("parts")
        if not isinstance(raw, (list, tuple)):
            if len(own) < len(given):
                raise ConfigError("--part: a run split over backends needs its parts before their flags",
                                  hint="pass --part KIND:N for each part, e.g. --part eks:2 --part local:1")
            return out
        try:
            parts = [parse_part(item, f"backend.parts[{i}]") for i, item in enumerate(raw)]
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for key, value in given.items():
            if key in own:
                continue
            takers = [p for p in parts if isinstance(p.get("kind"), str) and p["kind"] in backend_names()
                      and key in config_type(p["kind"]).flags]
            if not takers:
                flag = "--" + key.replace("_", "-")
                kinds = ", ".join(str(p.get("kind")) for p in parts)
                raise ConfigError(f"{flag}: no part of this run takes it (its parts: {kinds})",
                                  hint=f"drop {flag}, or set it in a part's section of the config file")
            for part in takers:
                part[config_type(part["kind"]).flags[key]] = value
        out["parts"] = parts
        return out


def _validated_part(item: Any, where: str) -> MixedPart:
    """One part as written, validated: its count, then its section by its own backend's model."""
    from diloco.executors.sections import backend_section

    section = parse_part(item, where)
    count = section.pop("replicas", None)
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"{where}.replicas: must be an integer >= 1 (got {short(count)})")
    if section.get("kind") == MIXED:
        raise ValueError(f"{where}.kind: a part cannot itself be split over backends (got 'mixed')")
    return MixedPart(replicas=count, config=backend_section(section, where))

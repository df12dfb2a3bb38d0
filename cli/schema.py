"""The JSON every ``-o json`` command prints, as one JSON Schema document (``docs/output-schema.json``).

``x-printed-by`` maps each command to the object it prints (``rm`` -> ``#/$defs/removal``); a test checks that
every command taking ``-o json`` is in it. The document itself constrains nothing at its root, so it can be used as
it is with a ``$ref`` to one object.

Regenerate after changing a report model: ``python -m diloco.cli.schema > docs/output-schema.json``; a test fails
while the file and the models disagree. Keys are only ever added within a ``schema_version``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from diloco.cli.render import SCHEMA_VERSION

#: The log line of ``diloco logs -o json`` (one object per line).
LOG_LINE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "rank": {"type": "integer", "description": "the replica"},
        "time": {"type": "number", "description": "when the line was written, unix seconds"},
        "stream": {"enum": ["out", "err"]},
        "text": {"type": "string", "description": "the line, without its newline"},
    },
    "required": ["rank", "time", "stream", "text"],
}


def output_schema() -> dict[str, Any]:
    """One document: which command prints which object, and each object's schema."""
    from pydantic import BaseModel, create_model

    from diloco.executors.base import LaunchPlan
    from diloco.launcher.doctor import DoctorReport
    from diloco.launcher.evaluate import EvalListing
    from diloco.launcher.housekeeping import RemovalReport
    from diloco.launcher.plot import PlotReport
    from diloco.launcher.reports import RunReport, RunSummary
    from diloco.launcher.scale import ScaleReport
    from diloco.launcher.smoke import SmokeReport

    runs_list: type[BaseModel] = create_model("RunList", runs=(list[RunSummary], ...))
    outputs: dict[str, tuple[type[BaseModel], tuple[str, ...]]] = {
        "run": (RunReport, ("launch", "watch", "status", "collect", "cancel")),
        "runs": (runs_list, ("runs",)),
        "plan": (LaunchPlan, ("launch --dry-run",)),
        "removal": (RemovalReport, ("rm", "prune")),
        "plot": (PlotReport, ("plot",)),
        "eval": (EvalListing, ("eval",)),
        "doctor": (DoctorReport, ("doctor",)),
        "smoke": (SmokeReport, ("smoke",)),
        "scale": (ScaleReport, ("scale",)),
    }
    defs: dict[str, Any] = {}
    printed_by: dict[str, str] = {}
    for name, (model, used_by) in outputs.items():
        schema = model.model_json_schema(ref_template="#/$defs/{model}")
        defs.update(schema.pop("$defs", {}))
        schema["properties"] = {"schema_version": {"const": SCHEMA_VERSION}, **schema.get("properties", {})}
        schema["description"] = f"printed by: {', '.join(used_by)}" + (
            " (launch with or without --detach)" if "launch" in used_by else "")
        defs[name] = schema
        printed_by.update(dict.fromkeys(used_by, name))
    defs["log_line"] = {**LOG_LINE_SCHEMA, "description": "printed by: logs (one object per line)"}
    printed_by["logs"] = "log_line"
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"diloco -o json output, schema_version {SCHEMA_VERSION}",
        "description": "x-printed-by names the object each command prints, one of $defs: validate what "
                       "`diloco rm -o json` prints against {\"$ref\": \"#/$defs/removal\"} in this document. "
                       "NaN and infinite numbers are printed as null (JSON has none).",
        "x-printed-by": dict(sorted(printed_by.items())),
        "$defs": dict(sorted(defs.items())),
    }


def main() -> int:
    sys.stdout.write(json.dumps(output_schema(), indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The JSON every ``-o json`` command prints, as one JSON Schema document (``docs/output-schema.json``).

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

    from diloco.doctor import DoctorReport
    from diloco.executors.base import LaunchPlan
    from diloco.orchestrate import RunReport, RunSummary
    from diloco.smoke import SmokeReport

    runs_list: type[BaseModel] = create_model("RunList", runs=(list[RunSummary], ...))
    outputs = {
        "run": (RunReport, "launch (with or without --detach), watch, status, collect, cancel"),
        "runs": (runs_list, "runs"),
        "plan": (LaunchPlan, "launch --dry-run"),
        "doctor": (DoctorReport, "doctor"),
        "smoke": (SmokeReport, "smoke"),
    }
    defs: dict[str, Any] = {}
    commands: dict[str, Any] = {}
    for name, (model, used_by) in outputs.items():
        schema = model.model_json_schema(ref_template="#/$defs/{model}")
        defs.update(schema.pop("$defs", {}))
        schema["properties"] = {"schema_version": {"const": SCHEMA_VERSION}, **schema.get("properties", {})}
        schema["description"] = f"printed by: {used_by}"
        defs[name] = schema
        commands[name] = {"$ref": f"#/$defs/{name}"}
    defs["log_line"] = {**LOG_LINE_SCHEMA, "description": "printed by: logs (one object per line)"}
    commands["log_line"] = {"$ref": "#/$defs/log_line"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"diloco -o json output, schema_version {SCHEMA_VERSION}",
        "description": "NaN and infinite numbers are printed as null (JSON has none).",
        "properties": commands,
        "$defs": dict(sorted(defs.items())),
    }


def main() -> int:
    sys.stdout.write(json.dumps(output_schema(), indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

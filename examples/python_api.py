"""Drive a local DiLoCo run from Python instead of the CLI: launch, wait, collect the agreed model.

    python examples/python_api.py [OUTPUT_DIR]

Two local replicas train a tiny built-in GPT for two outer rounds, meeting in a file:// store under
$DILOCO_HOME (default ~/.diloco); the run is recorded like any other, so `diloco status` and `diloco logs`
see it too. Prints where the model was written.
"""

from __future__ import annotations

import sys
from pathlib import Path

from diloco.launcher import api

#: The demo's config, beside this script in the repository.
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"


def main(output: str = "./") -> str:
    run = api.launch(
        CONFIG,
        replicas=2,
        train={"steps": 20, "sync_every": 10,
               "trainer_kwargs": {"n_embd": 16, "eval_batches": 1, "max_corpus_bytes": 200_000}},
    )
    print(f"launched {run.run_id}", file=sys.stderr)
    report = run.wait()
    print(f"{run.run_id} {report.state.value}; final eval loss {report.final_eval_loss}", file=sys.stderr)
    report = run.collect(output)
    if report.model_path is None:
        raise SystemExit(f"no model: {report.state.value}, {report.weights_detail}")
    return report.model_path


if __name__ == "__main__":
    print(main(*sys.argv[1:]))

"""Where things live in a run's rendezvous store: one place, shared by the replicas and the orchestrator.

    round_NNNNNN/rank_RRRR.safetensors   each rank's contribution to one all-reduce round (see diloco.allreduce)
    metrics/rank_RRRR.jsonl              the trainer's per-round metrics (init / round / final rows)
    final/rank_RRRR.safetensors          each rank's final global weights (identical across ranks)
    run.json                             the launcher's record of the run (id and resolved config)
"""

METRICS_KEY = "metrics/rank_{rank:04d}.jsonl"
FINAL_KEY = "final/rank_{rank:04d}.safetensors"
RUN_INFO_KEY = "run.json"

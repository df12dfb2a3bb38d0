"""Where things live in a run's rendezvous store: one place, shared by the replicas and the orchestrator.

    round_NNNNNN/rank_RRRR.safetensors   each rank's contribution to one all-reduce round (see diloco.allreduce);
                                         NNNNNN is the round's zero-based index: round 1 is round_000000
    metrics/rank_RRRR.jsonl              each rank's history: init, one row per outer round, final (diloco.metrics)
    progress/rank_RRRR.json              each rank's latest progress row, overwritten every few seconds
    final/rank_RRRR.safetensors          each rank's final global weights (identical across ranks)
    final/compacted.json                 after collect found every copy identical: the one copy kept and its hash
    committed/round_NNNNNN/{state.safetensors,COMMITTED}
                                         the global state after round NNNNNN (from 1), marker last (diloco.checkpoint)
    relaunch/rank_RRRR.json              a relaunch of rank RRRR in progress: peers extend their wait (launcher)
    run.json                             the launcher's record of the run (id and resolved config)
    sagemaker/{code,output,checkpoints}/ the SageMaker backend's code channel, job outputs and spot checkpoints
"""

METRICS_KEY = "metrics/rank_{rank:04d}.jsonl"
PROGRESS_KEY = "progress/rank_{rank:04d}.json"
FINAL_KEY = "final/rank_{rank:04d}.safetensors"
RUN_INFO_KEY = "run.json"

# Committed rounds (diloco.checkpoint): the global state after round N (numbered from 1), data then marker.
COMMITTED_PREFIX = "committed/"
COMMITTED_DATA_KEY = "committed/round_{round:06d}/state.safetensors"
COMMITTED_MARKER_KEY = "committed/round_{round:06d}/COMMITTED"
# Relaunches in progress (written by the launcher, read by peers' all-reduce to extend their wait).
RELAUNCH_KEY = "relaunch/rank_{rank:04d}.json"

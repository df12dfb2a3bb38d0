"""What runs inside a replica: ``python -m diloco.replica.entrypoint`` reads its settings, starts the local process
group, runs the trainer inside the DiLoCo outer loop, and writes metrics, checkpoints and final weights to the
store.

Nothing here imports the launcher (``diloco.launcher``), the CLI or a backend (``diloco.executors``): a replica
needs the store, the collectives and a trainer, and nothing of the machine that launched it.
"""

"""Defaults shared by the launcher and the replicas, in a module light enough for either to import."""

#: The module every replica runs with ``python -m``.
DEFAULT_ENTRYPOINT = "diloco.replica_entrypoint"
#: The trainer a replica runs unless told otherwise.
DEFAULT_TRAINER = "diloco.trainer:diloco_train"

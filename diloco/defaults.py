"""Defaults shared by the launcher and the replicas, in a module light enough for either to import."""

#: The module every replica runs with ``python -m``.
DEFAULT_ENTRYPOINT = "diloco.replica.entrypoint"
#: The trainer a replica runs unless told otherwise.
DEFAULT_TRAINER = "diloco.trainers.gpt:diloco_train"
#: How many times a failed replica is started again for its rank (``--max-restarts``): by the launcher while it
#: waits (local, SageMaker), or by the service itself from the moment the run is submitted (an Indexed Job's
#: per-index retry on EKS).
DEFAULT_MAX_RESTARTS = 3
#: How often a replica waiting in a round looks for its peers' uploads (``store.poll_interval_s``), in seconds,
#: once it has waited a while: a wait starts with quicker looks (after 1/16, 1/8, 1/4 and 1/2 of it), so an upload
#: that lands soon is noticed within about as long as the replica had waited for it, and a late one at most this
#: long after it landed. Each look is one object per waiting replica, 5N looks a second for N replicas (plus at most
#: four per wait). On S3 a look is one HEAD, found or not (``diloco.store.s3.object_exists``; s3fs's own ``exists``
#: would add a ListObjectsV2 after every 404, billed at 12.5 times a HEAD): at $0.0004 per 1,000 HEADs, about 0.7
#: cents per replica per hour of waiting at 0.2 s, 0.07 at 2 s; 5N requests a second stay below S3's 5,500
#: GET/HEAD per second per prefix up to about 1,100 replicas. On a
#: ``file://`` store it is a stat. Configs for huge runs or long rounds may raise it (``configs/sagemaker.yaml``).
DEFAULT_POLL_INTERVAL_S = 0.2
#: Seconds between the progress rows a replica writes between outer rounds (``diloco status`` reads the latest).
DEFAULT_PROGRESS_INTERVAL_S = 5.0

"""Loopback emulators of the cloud services diloco's backends talk to (SageMaker, Kubernetes).

Each speaks the real wire protocol to the real client library (boto3, the ``kubernetes`` client) and really runs
the replicas as local processes, so the backends are tested without patching a client. Each is usable on its
own, e.g. ``python -m tests.emulators.sagemaker --port 8765``, so a user can try a backend without an account.
"""

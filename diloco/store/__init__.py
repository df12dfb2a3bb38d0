"""The object store a run meets in, used by both programs: the replicas exchange through it, the launcher reads
results and state from it.

* ``objects``: the ``Store`` protocol, the local-folder store and ``open_store(url)``, with retries and traffic
  counters.
* ``s3``: the S3 store (boto3 for small objects, multipart for large ones).
* ``codec``: tensors as safetensors, never pickle.
* ``layout``: where every object of a run lives under its rendezvous prefix.
* ``logs``: replica log lines kept in the store (for backends whose own logs can be lost).
* ``aws_region``: the AWS region every client is given, resolved the way the AWS CLI resolves it.
"""

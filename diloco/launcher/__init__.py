"""What runs on the user's machine: the run configuration, launching through a backend (``launch``), the run and
its rules (``run``, ``lifecycle``, ``waiter``), its reports (``reports``), collecting the final weights,
housekeeping of old runs, ``doctor``, ``smoke`` and ``plot``.

The launcher reads what replicas write (metrics, weights, state) through the store and the records defined on
the replica side; a replica never imports anything from here.
"""

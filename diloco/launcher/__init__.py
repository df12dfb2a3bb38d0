"""What runs on the user's machine: the run configuration, the launch plan and its execution through a backend,
the view of a running run and the waiting on it, collecting the final weights, housekeeping of old runs,
``doctor``, ``smoke`` and ``plot``.

The launcher reads what replicas write (metrics, weights, state) through the store and the records defined on
the replica side; a replica never imports anything from here.
"""

"""diloco: DiLoCo across independent replica jobs that meet only through an object store.

Importing this package is cheap on purpose (no torch, no boto3): the CLI imports it on every start.
"""

__version__ = "0.1.0"

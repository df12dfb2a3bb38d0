"""Pseudo-gradient wire formats, one class in one module each, registered by name (``diloco.formats.registry``).

A format module holds everything about its format: its name, its parameters and their rules, the tag it writes in a
payload's metadata and checks on read, the wire tensors it makes of a tensor and their sizes, and its encoder and
decoder. Everything else reads formats through the registry: the store settings (``store.compression`` and the
format's parameters), the ``--compression`` flag, the all-reduce's codec (``diloco.collectives.wire``) and the
container that frames a payload (``diloco.collectives.compression``). So a new format is one new module here (or a
registered class anywhere), plus its page in the docs.

Why not inside ``diloco.collectives``: the store settings validate a format's name and parameters, and the store
may not import the collectives. A format module is light to import (no torch, no collectives at import time); its
encoder and decoder import their arithmetic (``diloco.formats.kernels.blockquant``, ``topk``) when they run.
"""

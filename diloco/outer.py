"""The outer loop's public path, ``diloco.outer.make_diloco_outer_loop``, kept for trainers written against it:
the loop itself lives in ``diloco.replica.outer``."""

from diloco.replica.outer import make_diloco_outer_loop

__all__ = ["make_diloco_outer_loop"]

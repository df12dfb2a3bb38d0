"""The built-in trainer's public path, ``diloco.trainer:diloco_train``, kept for configs written against it: the
trainer itself lives in ``diloco.trainers.gpt``."""

from diloco.trainers.gpt import diloco_train

__all__ = ["diloco_train"]

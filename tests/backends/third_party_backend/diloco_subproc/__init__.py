"""diloco-subproc: a diloco backend that runs each replica as a subprocess under its own small runner."""

from diloco_subproc.backend import SubprocBackend, SubprocConfig, SubprocHandle

__all__ = ["SubprocBackend", "SubprocConfig", "SubprocHandle"]

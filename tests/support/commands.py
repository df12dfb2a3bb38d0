"""The ``diloco`` command as tests run it, in the two forms a user has: the installed console script, and the
module through the test's own interpreter (which needs no script on PATH and carries ``sys.executable``'s flags)."""

from __future__ import annotations

import sys
from pathlib import Path

#: The console script ``pip install`` puts beside this interpreter: what a user types.
DILOCO_SCRIPT = str(Path(sys.executable).with_name("diloco"))
#: The CLI as a module of this interpreter, for an argv list.
DILOCO_MODULE = [sys.executable, "-m", "diloco.cli.main"]

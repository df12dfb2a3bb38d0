"""Scheduling for pytest-xdist that runs a module marked ``xdist_group`` on one worker as a single unit.

Why: such a module shares a module-scoped fixture that starts something costly (a real run, a server); scheduled
test by test, each worker that draws one of its tests starts it again. xdist's own ``--dist loadgroup`` does this
by appending ``@group`` to each marked test's node id on the workers, which pytest 9.2's read-only node ids no
longer allow (the suffix is silently lost and the group's tests are spread over the workers). This scheduler reaches
the same result on the controller, which sees only node ids: a test's unit of work is its module when the module's
source declares ``pytestmark`` with ``xdist_group``, else the test alone. Units go out in collection order.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from xdist.scheduler.loadscope import LoadScopeScheduling

#: A module-level ``pytestmark`` that names ``xdist_group``, on one line (as every marked module writes it).
_MARKED = re.compile(r"^pytestmark\s*=.*\bxdist_group\(", re.MULTILINE)


@functools.cache
def _module_is_grouped(rootdir: str, path: str) -> bool:
    try:
        return _MARKED.search((Path(rootdir) / path).read_text()) is not None
    except OSError:
        return False


class ModuleGroupScheduling(LoadScopeScheduling):
    """``LoadScopeScheduling`` whose scope is the module for a marked module and the test itself otherwise."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return path if _module_is_grouped(str(self.config.rootpath), path) else nodeid

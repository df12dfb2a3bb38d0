"""Scheduling for pytest-xdist that runs a module marked ``xdist_group`` on one worker as a single unit.

Why: such a module shares a module-scoped fixture that starts something costly (a real run, a server); scheduled
test by test, each worker that draws one of its tests starts it again. xdist's own ``--dist loadgroup`` does this
by appending ``@group`` to each marked test's node id on the workers, which pytest 9.2's read-only node ids no
longer allow (the suffix is silently lost and the group's tests are spread over the workers). This scheduler reaches
the same result on the controller, which sees only node ids: a test's unit of work is its group when the module's
source declares ``pytestmark`` with ``xdist_group("name")`` (every module of that name together: modules that share
a session-scoped run), else the test alone. Units go out in collection order.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from xdist.scheduler.loadscope import LoadScopeScheduling

#: A module-level ``pytestmark`` that names ``xdist_group("name")``, on one line (as every marked module writes it).
_MARKED = re.compile(r"""^pytestmark\s*=.*\bxdist_group\(\s*["']([^"']+)["']""", re.MULTILINE)


@functools.cache
def _module_group(rootdir: str, path: str) -> str | None:
    """The ``xdist_group`` name the module at ``path`` declares, if any."""
    try:
        found = _MARKED.search((Path(rootdir) / path).read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def scope_of(rootdir: str, nodeid: str) -> str:
    """The unit of work a test goes out in: its module's ``xdist_group``, else the test itself."""
    group = _module_group(rootdir, nodeid.split("::", 1)[0])
    return f"xdist_group:{group}" if group else nodeid


class ModuleGroupScheduling(LoadScopeScheduling):
    """``LoadScopeScheduling`` whose scope is the group for a marked module and the test itself otherwise."""

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(str(self.config.rootpath), nodeid)

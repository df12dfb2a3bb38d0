"""The one line ``diloco --help`` lists for each command, and the exit codes each command's ``--help`` ends with.

In one place because both go wrong when left to each command: click lists a command by the first sentence of its
docstring, cut at the first period (``Wait on a run (e.g.``) or at the terminal's edge (``...``); and one shared
epilog made every command claim ``launch``'s exit codes, though plain ``status`` exits 0 once it has shown a failed
run. The codes follow README's "Exit codes" table; ``apply`` sets both on the registered commands.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

#: The width help is written for (click's own limit).
HELP_WIDTH = 80

#: The last paragraph of every command's help.
ENVIRONMENT = "Set DILOCO_DEBUG=1 for tracebacks, DILOCO_HOME for where runs are recorded (default ~/.diloco)."

#: The top-level help's epilog: the codes of the commands that wait on a run, and where the others are.
TOP_EPILOG = ("Exit codes of launch, watch and collect: 0 all replicas succeeded (and the final weights agree), "
              "1 a replica failed, 2 usage or config error (nothing launched), 3 launch refused by the service, "
              "cluster or store (nothing launched or left), 4 cancelled, 5 succeeded with replicas left behind "
              "(--min-replicas), 124 timeout, 130 interrupted. "
              "`diloco COMMAND --help` lists each command's own. " + ENVIRONMENT)

_USAGE = "usage error or unknown RUN: nothing was done"
_LEFT_BEHIND = "succeeded without the replicas it left behind (--min-replicas)"


@dataclass(frozen=True)
class CommandHelp:
    """What ``diloco --help`` says of a command (one line, at most about 60 characters) and its exit codes."""

    summary: str
    exit_codes: tuple[tuple[int, str], ...]

    def epilog(self) -> str:
        """``Exit codes:``, one code a line with its meaning wrapped beside it to fit 80 columns (click keeps a
        ``\\b`` paragraph as written, under its own two-space indent), then the environment."""
        width = max(len(str(code)) for code, _ in self.exit_codes)
        lines = []
        for code, meaning in self.exit_codes:
            wrapped = textwrap.wrap(meaning, width=HELP_WIDTH - 2 - (2 + width + 2), break_on_hyphens=False)
            lines.append(f"  {str(code).ljust(width)}  {wrapped[0]}")
            lines += [f"  {' ' * width}  {more}" for more in wrapped[1:]]
        return "\b\nExit codes:\n" + "\n".join(lines) + f"\n\n{ENVIRONMENT}"


COMMANDS: dict[str, CommandHelp] = {
    "launch": CommandHelp("Start a run; wait on it with a live table unless --detach.", (
        (0, "every replica succeeded and the final weights agree (--detach, --dry-run: launched, planned)"),
        (1, "a replica failed, or the final weights disagree or could not be checked"),
        (2, "usage or config error: nothing was launched"),
        (3, "refused by the service, cluster or store: nothing was launched or left"),
        (4, "the run was cancelled"),
        (5, _LEFT_BEHIND),
        (124, "a replica reached the run's time limit (--timeout)"),
        (130, "interrupted (Ctrl-C): the run keeps going, unless --cancel-on-interrupt"),
    )),
    "watch": CommandHelp("Wait on a run as launch does, relaunching failed replicas.", (
        (0, "every replica succeeded and the final weights agree"),
        (1, "a replica failed for good, or the final weights disagree or could not be checked"),
        (2, _USAGE),
        (4, "the run was cancelled"),
        (5, _LEFT_BEHIND),
        (124, "a replica reached the run's time limit (--timeout)"),
        (130, "interrupted (Ctrl-C): stops watching; the run keeps going (or had already ended)"),
    )),
    "status": CommandHelp("Show a run's replicas: state, step, losses, why one failed.", (
        (0, "the run was shown, whatever its state (--watch: it succeeded)"),
        (1, "the run could not be read (the message says why); --watch: a replica failed"),
        (2, _USAGE),
        (4, "--watch: the run was cancelled"),
        (5, f"--watch: {_LEFT_BEHIND}"),
        (124, "--watch: a replica reached the run's time limit"),
        (130, "interrupted (Ctrl-C): the run is unaffected"),
    )),
    "logs": CommandHelp("Print the replicas' output in time order; -f follows it.", (
        (0, "the logs were printed (also when there were none yet)"),
        (1, "the logs could not be read (the message says why)"),
        (2, _USAGE),
        (130, "interrupted (Ctrl-C): stops following, the run is unaffected"),
    )),
    "collect": CommandHelp("Wait for a run, check its final weights agree, write the model.", (
        (0, "every replica succeeded, the final weights agree and the model was written"),
        (1, "a replica failed, or the final weights disagree or could not be checked"),
        (2, "usage error, unknown RUN or unusable --output: nothing was waited for"),
        (4, "the run was cancelled"),
        (5, f"{_LEFT_BEHIND}; the model was written"),
        (124, "--timeout reached (the run goes on), or a replica reached the run's time limit"),
        (130, "interrupted (Ctrl-C): the run keeps going"),
    )),
    "cancel": CommandHelp("Stop every replica of a run (a second cancel kills at once).", (
        (0, "the run was cancelled, or had already ended"),
        (1, "the backend could not be asked to stop it (the message says why)"),
        (2, _USAGE),
        (130, "interrupted while waiting: the replicas are being stopped all the same"),
    )),
    "runs": CommandHelp("List the runs recorded under $DILOCO_HOME, oldest first.", (
        (0, "the runs were listed"),
        (1, "a run's state could not be read (the message says why)"),
        (2, "DILOCO_HOME cannot be used, or a usage error"),
        (130, "interrupted (Ctrl-C)"),
    )),
    "rm": CommandHelp("Remove runs that have ended: record, logs, store objects.", (
        (0, "every run given was removed (--dry-run: would be)"),
        (1, "a run was kept: still going (stop it with diloco cancel), or its store unreachable"),
        (2, "usage error or unknown RUN: nothing was removed"),
        (130, "interrupted (Ctrl-C): run it again to finish"),
    )),
    "prune": CommandHelp("Remove every run that ended more than AGE ago, as rm does.", (
        (0, "every run that ended before AGE was removed; runs still going are kept"),
        (1, "a run that has ended could not be removed (e.g. its store was unreachable)"),
        (2, "usage error (e.g. an AGE without a unit): nothing was removed"),
        (130, "interrupted (Ctrl-C): run it again to finish"),
    )),
    "plot": CommandHelp("Draw a run's train and eval loss curves into a PNG.", (
        (0, "the PNG was written"),
        (1, "the run's metrics could not be read or drawn (the message says why)"),
        (2, "usage error, unknown RUN, no losses yet, or matplotlib missing"),
        (130, "interrupted (Ctrl-C)"),
    )),
    "scale": CommandHelp("Grow or shrink a live elastic run's replicas.", (
        (0, "the run was scaled (new replicas started, or leaving ones told to drain), or already had that many"),
        (1, "the backend could not start the new replicas (the membership was put back)"),
        (2, "usage error, unknown RUN, a run that ended or is not elastic, or a count outside its bounds"),
        (130, "interrupted (Ctrl-C)"),
    )),
    "smoke": CommandHelp("Run a tiny end-to-end DiLoCo job on a backend, with checks.", (
        (0, "every check passed"),
        (1, "a check failed (the table says which, and the fix)"),
        (2, "usage error, or it would cost money and --yes was not given: nothing was started"),
        (124, "the replicas did not finish within --timeout"),
        (130, "interrupted (Ctrl-C): its replicas are stopped and its files removed"),
    )),
    "doctor": CommandHelp("Check what a launch on a backend needs, with each fix.", (
        (0, "no check failed"),
        (1, "a check failed (the table says which, and the fix)"),
        (2, "usage or config error"),
        (130, "interrupted (Ctrl-C)"),
    )),
}


def _name(info: Any) -> str:
    """A registered command's name as Typer derives it (``runs_`` registered as ``runs``; else the function's)."""
    return str(info.name or info.callback.__name__.lower().replace("_", "-"))


def apply(app: Any) -> None:
    """Give every registered command of ``app`` (a ``typer.Typer``) its summary line and its own exit codes."""
    for info in app.registered_commands:
        entry = COMMANDS.get(_name(info))
        if entry is not None:
            info.short_help = entry.summary
            info.epilog = entry.epilog()

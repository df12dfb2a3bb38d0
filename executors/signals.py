"""Signals while a launcher holds half a run: SIGTERM behaves like Ctrl-C, and critical steps are not cut in two.

Why this module exists: a launcher that is starting N replicas is the only process that knows which of them exist
until it has recorded them. Python turns Ctrl-C into ``KeyboardInterrupt`` (so ``except BaseException`` rolls the
launch back), but SIGTERM (``kill``, a CI runner's timeout, a closing terminal's SIGHUP) kills the interpreter on
the spot, without running any clean-up, and leaves the replicas already started running unseen. Two tools:

* ``terminate_as_interrupt()``: while the block runs, SIGTERM and SIGHUP raise ``KeyboardInterrupt`` in the main
  thread, so the one Ctrl-C path (roll back, exit 130) also serves them. A signal the process ignores (``nohup``)
  stays ignored.
* ``signals_deferred()``: while the block runs, SIGINT, SIGTERM and SIGHUP are held instead of acted on, so a step
  such as "start a process and record its pid" or "stop what was started" is never interrupted half-way; the block
  can ask whether one arrived (to hurry up), and on exit the first held signal is handed to the handler that was in
  place, exactly as if it had arrived then.

Both only act in the main thread (Python runs signal handlers there and nowhere else); elsewhere they do nothing.
Standard library only: the CLI imports this while it launches.

A signal's exception can be lost: Python raises it wherever the main thread is when the signal arrives, and if that
is a finalizer (an unreferenced file object's ``__del__``, run by the garbage collector in the middle of anything)
CPython discards it without a trace, so a Ctrl-C during a wait would be ignored and the command would run on to
its end. So within ``terminate_as_interrupt`` every stop signal (Ctrl-C included), and within
``interrupts_recorded`` (a wait on a run) every Ctrl-C, is also written down when its exception is raised:
``raise_if_lost()``, which a waiting loop calls each poll, raises it again.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["Terminated", "interrupts_recorded", "raise_if_lost", "signals_deferred", "terminate_as_interrupt"]

#: The signals that stop a launcher by default and that a launcher therefore turns into its rollback.
TERMINATING: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGHUP)
#: What ``signals_deferred`` holds by default: Ctrl-C and the terminating signals.
STOPPING: tuple[signal.Signals, ...] = (signal.SIGINT, *TERMINATING)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C's ``KeyboardInterrupt`` would be, so one rollback path serves all.

    A subclass (not a new base) on purpose: every ``except KeyboardInterrupt`` already written handles it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} received")


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


#: Stop signals whose exception was raised inside a ``terminate_as_interrupt`` block and has not yet left it: an
#: exception that leaves the block (or is raised again by ``raise_if_lost``) clears its entry.
_raised: list[int] = []


def _interrupt_from(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _raise_terminated(signum: int, _frame: FrameType | None) -> None:
    _raised.append(signum)
    raise Terminated(signum)


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    """Ctrl-C as Python's own handler treats it (``KeyboardInterrupt``), written down first."""
    _raised.append(signum)
    raise KeyboardInterrupt


def raise_if_lost() -> None:
    """Raise again a stop signal whose exception was raised in a ``terminate_as_interrupt`` block and lost on the
    way (see the module's docstring). A loop that waits calls this each time round: while its exception was
    travelling the loop could not be running, so a signal written down and still there was lost."""
    if _raised:
        signum = _raised[0]
        _raised.clear()
        raise _interrupt_from(signum)


@contextmanager
def interrupts_recorded() -> Iterator[None]:
    """Within the block, Ctrl-C raises its ``KeyboardInterrupt`` as always and is written down, so that one lost in
    a finalizer is raised again by the next ``raise_if_lost``. For a wait on a run outside any launch's block (a
    waiting ``launch``, ``watch``, ``collect``): without it a swallowed Ctrl-C leaves the command waiting until the
    run ends. A Ctrl-C handler of the caller's own (not Python's) is left in place, as are the other signals."""
    if not _in_main_thread():
        yield
        return
    ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ours:
        signal.signal(signal.SIGINT, _raise_interrupt)
    outer = list(_raised)
    try:
        yield
    except BaseException:
        _raised[:] = outer  # the block's own signal, if any, is this exception: it has left the block
        raise
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)


@contextmanager
def terminate_as_interrupt(signals: tuple[signal.Signals, ...] = TERMINATING) -> Iterator[None]:
    """Within the block, ``signals`` (SIGTERM, SIGHUP) raise ``Terminated`` (a ``KeyboardInterrupt``), and Ctrl-C
    its ``KeyboardInterrupt`` as always; each is written down, so that one lost in a finalizer is raised again by
    the next ``raise_if_lost``, inside the block or after it. Not when the block ends: the code after a block (a
    launch that has submitted its replicas) may have no rollback for it, while the next wait on the run handles a
    Ctrl-C as it handles any other.

    The previous handlers come back when the block ends, however it ends. Ignored signals stay ignored, and a
    Ctrl-C handler of the caller's own (not Python's) is left in place.
    """
    if not _in_main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in signals}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, _raise_terminated)
    try:
        with interrupts_recorded():
            yield
    finally:
        _restore(previous)


@contextmanager
def signals_deferred(signals: tuple[signal.Signals, ...] = STOPPING) -> Iterator[Callable[[], bool]]:
    """Hold ``signals`` for the duration of the block; yields ``arrived()``, true once one has been held.

    On exit the previous handlers are restored and the first held signal is delivered to its previous handler
    (Ctrl-C's ``KeyboardInterrupt``, ``Terminated`` inside ``terminate_as_interrupt``, or the default action,
    which for SIGTERM ends the process: later than asked, but only once the critical step is complete).
    """
    if not _in_main_thread():
        yield lambda: False
        return
    held: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        held.append(signum)

    previous = {sig: signal.getsignal(sig) for sig in signals}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, hold)
    try:
        yield lambda: bool(held)
    finally:
        _restore(previous)
        if held:
            _deliver(held[0], previous[signal.Signals(held[0])])


def _restore(previous: dict[signal.Signals, Any]) -> None:
    for sig, handler in previous.items():
        # ``None`` means a handler installed from C that Python cannot reinstall; the default is the safe choice.
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _deliver(signum: int, handler: Any) -> None:
    """Act on a held signal as its previous handler would have when it arrived."""
    if handler is signal.SIG_IGN:
        return
    if callable(handler):
        handler(signum, None)
        return
    signal.raise_signal(signum)  # SIG_DFL (or unknown): the default action, now that the handler is back

"""SIGINT and SIGTERM held back while work that must not be cut in two runs, then delivered; and
acted on while a call that would drop them waits.

Starting worker processes is such work: an interrupt raised halfway through would leave some
started and some not, or cut a ``spawn`` child's start-up data short (it dies printing an
``EOFError`` traceback). :func:`interrupts_held` makes the interrupt wait until the work is done
and then delivers it to the handlers that were in place, so the program unwinds as it would have.

The commands' side: :func:`raise_on_sigterm` makes SIGTERM unwind like Ctrl-C
(:class:`Terminated`, a ``KeyboardInterrupt``), so that every ``with`` and ``finally`` that ends a
worker runs, and :func:`interrupt_behind` reports an error that follows an interrupt (a worker
that died of the same group signal) as that interrupt. :func:`launch` starts a command with both
signals acted on from its first moment: while its modules load (a second or more on a busy
machine), not only once its ``main`` has put its handlers in place.

The opposite case: a call whose wait swallows the interrupt, as a C library that retries its
wait when a signal interrupts it and drops the exception the Python handler raised. vLLM's
engine start-up waits so for its engine's handshake (pyzmq's poll), for up to ten minutes, and
for ever in effect when the engine died of the same signal. :func:`interruptible` runs such a
call in a thread of its own while this one waits, where the interrupt is raised.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = [
    "INTERRUPTS",
    "Terminated",
    "deliver",
    "interrupt_behind",
    "interrupted_status",
    "interruptible",
    "interrupts_held",
    "interrupts_raised",
    "launch",
    "raise_on_sigterm",
    "reporting_interrupts",
    "signal_name",
]

T = TypeVar("T")

#: The signals that end a command: Ctrl-C, and a job scheduler's or a parent's SIGTERM.
INTERRUPTS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def interrupts_held(*, delivered: bool = True, spawning: bool = False) -> Iterator[list[int]]:
    """Hold SIGINT and SIGTERM back while the body runs; yield the list they are noted in.

    Two holds, since either alone leaks. The signals are blocked in this thread: a process
    started inside inherits the mask and holds them too until it unblocks them. And their
    Python handlers only note them: the kernel hands a process-directed signal to any thread
    that does not block it, and that thread's C handler would still have the main thread's
    Python handler raise mid-body (only the main thread can change handlers; elsewhere the
    mask alone holds). On the way out, the handlers are put back and, with ``delivered``,
    the noted signals raised to them; else the caller does it with :func:`deliver` after its
    own clean-up. A process *forked* inside inherits the noting handlers as well as the mask:
    it must set its own before it unblocks the signals. A signal this process ignores stays
    ignored, for it and for every process it starts (SIGINT in a background job).

    ``spawning``: the body starts ``spawn`` or ``forkserver`` processes. The first such start
    in a process starts multiprocessing's resource tracker, and CPython unblocks both signals
    in this thread once the tracker is up: the processes started after it (a fork server, which
    takes seconds to import its preload modules before it ignores Ctrl-C) would not hold them.
    The tracker is started before the signals are blocked instead.
    """
    if spawning:
        # Here, not at the top: every command loads this module before its signals are held
        # (launch), and multiprocessing would be 13 ms of that unguarded start.
        import multiprocessing.resource_tracker

        multiprocessing.resource_tracker.ensure_running()
    noted: list[int] = []
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in INTERRUPTS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, lambda s, _: noted.append(s))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTS)
    try:
        yield noted
    finally:
        # Unblocking runs the noting handlers on what came meanwhile (pthread_sigmask checks for
        # pending signals before it returns); the handlers are then put back, all of them even
        # if one is raised on the way, before anything is delivered to them.
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        with contextlib.ExitStack() as restore:
            for signum, handler in previous.items():
                # None: a handler installed outside Python, which Python cannot put back.
                restore.callback(
                    signal.signal, signum, signal.SIG_DFL if handler is None else handler
                )
        if delivered:
            deliver(noted)


def deliver(noted: list[int]) -> None:
    """Raise each signal :func:`interrupts_held` noted (once each) to this process's handlers."""
    for signum in dict.fromkeys(noted):
        signal.raise_signal(signum)


def interruptible(
    fn: Callable[..., T], *args: Any, on_interrupt: Callable[[], None], **kwargs: Any
) -> T:
    """``fn(*args, **kwargs)``, its interrupts acted on however it waits.

    In the main thread, ``fn`` runs in a daemon thread while the main thread waits for it (a
    wait a signal interrupts): SIGINT or SIGTERM raises there, ``on_interrupt()`` then ends what
    ``fn`` started (its processes; the thread is left to end with them, or with this process),
    and the interrupt goes on. ``fn``'s result or exception is this call's. Elsewhere (signals
    reach only the main thread) ``fn`` runs here.
    """
    if threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=body, name=f"interruptible {fn.__name__}", daemon=True)
    thread.start()
    try:
        thread.join()
    except BaseException:
        on_interrupt()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program was, so that it unwinds like Ctrl-C does."""


#: The interrupts this process has received (their signal numbers), in order.
_RECEIVED: list[int] = []


def _on_interrupt(signum: int, frame: Any) -> None:
    _RECEIVED.append(signum)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def raise_on_sigterm() -> None:
    """From now on SIGTERM raises :class:`Terminated` in the main thread, and both it and SIGINT
    (unless SIGINT is ignored, as in a background job) are remembered for
    :func:`interrupt_behind`."""
    _RECEIVED.clear()
    signal.signal(signal.SIGTERM, _on_interrupt)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_interrupt)


@contextlib.contextmanager
def interrupts_raised() -> Iterator[None]:
    """:func:`raise_on_sigterm` while the body runs (a command's ``main``), the handlers that
    were in place put back after it."""
    previous = {signum: signal.getsignal(signum) for signum in INTERRUPTS}
    raise_on_sigterm()
    try:
        yield
    finally:
        for signum, handler in previous.items():  # None: set outside Python, not restorable
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The interrupt that ``exc`` follows from: ``exc`` itself when it is one; else, once this
    process has received SIGINT or SIGTERM, a new interrupt of the last one received; else None.

    An error raised after an interrupt is its consequence: a job scheduler, ``timeout`` or
    Ctrl-C signals the whole process group, and a worker process that dies of the signal before
    this one has acted on it leaves a broken pipe or a closed connection behind."""
    if isinstance(exc, KeyboardInterrupt):
        return exc
    if not _RECEIVED:
        return None
    return Terminated() if _RECEIVED[-1] == signal.SIGTERM else KeyboardInterrupt()


def reporting_interrupts(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``; an error it raises after an interrupt (:func:`interrupt_behind`) is raised
    as that interrupt, from the error: a command's way to end in its one line for the signal."""
    try:
        return fn(*args)
    except Exception as exc:
        interrupt = interrupt_behind(exc)
        if interrupt is None:
            raise
        raise interrupt from exc


def signal_name(exc: KeyboardInterrupt) -> str:
    """The signal behind an interrupt: ``"SIGTERM"`` for :class:`Terminated`, else ``"SIGINT"``."""
    return "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"


def interrupted_status(exc: KeyboardInterrupt) -> int:
    """The exit status of a command ended by a signal: 128 + its number (130 SIGINT, 143 SIGTERM)."""
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)


def launch(prog: str, module: str) -> int:
    """Run the command ``prog``: ``module``'s ``main()``, imported with SIGINT and SIGTERM held.

    A command's modules take a second or more to load on a busy machine, before its ``main`` puts
    its handlers in place; a signal then would end it by the default action (no word for SIGTERM,
    a traceback of whatever was importing for SIGINT). Held, it ends the command in one line with
    128 + its number instead, nothing having been done. A signal the command was started with
    ignored (SIGINT in a background job) stays ignored.
    """
    with interrupts_held(delivered=False) as noted:
        main = importlib.import_module(module).main
    if noted:
        name = signal.Signals(noted[0]).name
        print(
            f"{prog}: interrupted by {name} while starting, before doing anything; "
            "run the same command again",
            file=sys.stderr,
        )
        return 128 + noted[0]
    return main()

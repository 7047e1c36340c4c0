"""SIGINT and SIGTERM held back while work that must not be cut in two runs, then delivered; and
acted on while a call that would drop them waits.

Starting worker processes is such work: an interrupt raised halfway through would leave some
started and some not, or cut a ``spawn`` child's start-up data short (it dies printing an
``EOFError`` traceback). :func:`interrupts_held` makes the interrupt wait until the work is done
and then delivers it to the handlers that were in place, so the program unwinds as it would have.

The opposite case: a call whose wait swallows the interrupt, as a C library that retries its
wait when a signal interrupts it and drops the exception the Python handler raised. vLLM's
engine start-up waits so for its engine's handshake (pyzmq's poll), for up to ten minutes, and
for ever in effect when the engine died of the same signal. :func:`interruptible` runs such a
call in a thread of its own while this one waits, where the interrupt is raised.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["INTERRUPTS", "deliver", "interruptible", "interrupts_held"]

T = TypeVar("T")

#: The signals that end a command: Ctrl-C, and a job scheduler's or a parent's SIGTERM.
INTERRUPTS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def interrupts_held(*, delivered: bool = True) -> Iterator[list[int]]:
    """Hold SIGINT and SIGTERM back while the body runs; yield the list they are noted in.

    Two holds, since either alone leaks. The signals are blocked in this thread: a process
    started inside inherits the mask and holds them too until it unblocks them. And their
    Python handlers only note them: the kernel hands a process-directed signal to any thread
    that does not block it, and that thread's C handler would still have the main thread's
    Python handler raise mid-body (only the main thread can change handlers; elsewhere the
    mask alone holds). On the way out, the handlers are put back and, with ``delivered``,
    the noted signals raised to them; else the caller does it with :func:`deliver` after its
    own clean-up. A process *forked* inside inherits the noting handlers as well as the mask:
    it must set its own before it unblocks the signals.
    """
    noted: list[int] = []
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in INTERRUPTS:
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

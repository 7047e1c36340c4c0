"""Running a stage or an evaluation in a fresh process of its own, and waiting for it."""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import pickle
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from birdenv.interrupts import INTERRUPTS, interrupt_behind, interrupts_held, raise_on_sigterm
from birdtrain.config import CurriculumConfig
from birdtrain.errors import ProcessDiedError
from birdtrain.policies import uses_vllm

__all__ = ["isolated", "isolates"]


def isolates(cfg: CurriculumConfig) -> bool:
    """``cfg.isolate``; None: when CUDA is present (each process then starts on a clean GPU), or
    when a stage generates with vLLM (TRL's colocated engine makes its process a
    ``torch.distributed`` rank, and a later trainer there would wrap its model for data
    parallelism)."""
    if cfg.isolate is not None:
        return cfg.isolate
    # the train extra: imported only where used
    import torch

    return torch.cuda.is_available() or any(
        stage.enabled and uses_vllm(stage.use_vllm, cfg.model.name_or_path)
        for stage in (cfg.stage3, cfg.stage4)
    )


def _die_with_parent() -> None:
    """Have Linux send this process SIGTERM when its parent dies (a killed curriculum leaves no
    stage running on behind it)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _child(conn: Any, fn: Any, args: tuple, kwargs: dict) -> None:
    """The body of an isolated process: run ``fn`` and send back its result or its exception.

    SIGTERM (from the parent on an interrupt, or from the system when the parent dies) unwinds it
    like Ctrl-C, ending its own workers on the way out."""
    _die_with_parent()
    raise_on_sigterm()
    try:
        # The parent held the interrupts back while it started this process (see isolated);
        # one that came meanwhile is raised here, inside the handling below.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS)
        result = fn(*args, **kwargs)
    except BaseException as exc:
        interrupt = interrupt_behind(exc)
        if interrupt is None:
            traceback.print_exc()
        else:  # the parent reports an interrupt, and what follows from one (a dead worker)
            exc = interrupt
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # it would not arrive whole (e.g. a constructor with other arguments)
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        conn.send(("error", exc))
        sys.exit(1)
    conn.send(("ok", result))


def isolated(
    cfg: CurriculumConfig, run_dir: Path, name: str, fn: Any, *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)``, in a process of its own when :func:`isolates` says so.

    The process is started fresh (``spawn``: it inherits no CUDA state, and none of this
    process's memory), and this one waits for it to exit before going on, so every stage and
    evaluation starts on a GPU no other holds. Its exception is raised here; each process is
    recorded in ``run_dir/processes.jsonl`` (``name``, ``pid``, ``started``, ``exited``,
    ``exitcode``).
    """
    if not isolates(cfg):
        return fn(*args, **kwargs)
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    sys.stdout.flush()
    sys.stderr.flush()
    process = context.Process(target=_child, args=(send, fn, args, kwargs), name=name)
    started = time.time()
    try:
        # An interrupt that comes while the process starts is raised once it has, here, where
        # the process is ended with this one. It inherits the mask until _child unblocks it.
        with interrupts_held(spawning=True):
            process.start()
            send.close()
        outcome = receive.recv()
    except EOFError:
        outcome = None  # it died before it could say anything (killed, or a crash in native code)
    except BaseException:  # an interrupt here: the process is ended with this one, not orphaned
        if process.pid is not None:
            process.terminate()
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
        raise
    finally:
        if process.pid is not None:
            process.join()
        receive.close()
    record = {
        "name": name,
        "pid": process.pid,
        "started": started,
        "exited": time.time(),
        "exitcode": process.exitcode,
    }
    with open(run_dir / "processes.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    if outcome is None:
        raise ProcessDiedError(
            f"{name}: its process (pid {process.pid}) ended with exit code {process.exitcode} "
            "before returning a result (killed for memory? see the system log); rerun to resume"
        )
    status, value = outcome
    if status == "error":
        raise value
    return value

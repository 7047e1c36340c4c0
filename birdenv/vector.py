"""Vectorized ``BirdCritic-SQLite-v0``, ``BirdCritic-PostgreSQL-v0`` and ``BirdSQL-SQLite-v0``: N
trajectories at once over one replica store (or PostgreSQL server), of one task kind or of a
weighted mixture.

:func:`make_vec` builds N copies of the environment, in worker processes
(:class:`gymnasium.vector.AsyncVectorEnv`), in this one (:class:`gymnasium.vector.SyncVectorEnv`),
or in Ray actors over a cluster (``backend="ray"``: :class:`birdenv.ray_vector.RayVectorEnv`)::

    from birdenv.vector import make_vec

    envs = make_vec(8, seed=0)                  # 8 worker processes, suite "critic-mini"
    prompts, infos = envs.reset()
    prompts, rewards, terminated, truncated, infos = envs.step(turns)   # turns: 8 strings

Every copy leases one session per episode from its process's replica pool, and every pool sits on
the same root (``$BIRDENV_HOME/replicas``, or ``pool_options={"root": ...}``): the bases are
materialised once and shared read-only by all workers, each episode writes only its own files, and
no worker is given a partition of anything (pools recognise each other's files by ``flock``).

Gymnasium's own constructor works too::

    gymnasium.make_vec("BirdCritic-SQLite-v0", num_envs=4, vectorization_mode="async",
                       vector_kwargs={"shared_memory": False})

``shared_memory=False`` is required, and :func:`make_vec` sets it. With ``True`` (Gymnasium's
default for ``vectorization_mode="async"``) Gymnasium 1.4 decodes the shared text buffer once, when
the vector env is built, and hands back that stale snapshot (1,048,576 NULs) as every
observation afterwards, without an error.

Mixtures of task kinds
----------------------
One vector env can hold debugging and text-to-SQL episodes at once, on SQLite and PostgreSQL.
Every copy is then a :class:`MixedTaskEnv` (:mod:`birdenv.envs.mixed`): it owns one env per named
task source (each of its tasks' kind and dialect), routes ``reset(options={"task_id": ...})`` to the env that owns the task, and on a
plain ``reset()`` draws the source by weight with its own ``np_random`` (seeded, reproducible).
Observation and action spaces are the same text spaces as either env's, so a rollout loop cannot
tell the difference::

    envs = make_vec(8, mixture={"gym-mini": 0.7, "bird-mini-train": 0.3}, seed=0)
    envs = make_vec(8, tasks=critic_tasks + bird_tasks)    # weights: the sources' sizes
    envs = make_vec(8, mixture={"gym-mini": 0.5, "gym-mini-pg": 0.5})   # SQLite and PostgreSQL

``info["source"]`` names the source of each episode.

Autoreset: what a rollout loop must do
--------------------------------------
Gymnasium 1.x vector environments reset a finished copy on the **next** call to ``step``
(``AutoresetMode.NEXT_STEP``, the default). After ``terminated[i] or truncated[i]``:

1. the reward and the verdict of the finished episode come with *that* step (batched key by key:
   ``infos["verdict"]["status"][i]``, present where ``infos["_verdict"][i]``);
2. on the following ``step``, copy ``i`` **ignores its action**, starts a new episode and returns
   the new task's prompt as its observation, with reward 0 and both flags ``False``; its
   ``infos["task_id"]`` names the new task.

So keep a boolean array ``autoreset = terminated | truncated``; in the next step send any text for
those copies (it is discarded), and treat their observation as a fresh prompt (start a new
conversation), not as a tool response. Alternatives: ``vector_kwargs={"autoreset_mode":
gymnasium.vector.AutoresetMode.SAME_STEP}`` (the new prompt arrives in the same step; the final
observation and the verdict in ``infos["final_obs"]`` and ``infos["final_info"]``), or
``AutoresetMode.DISABLED`` and ``envs.reset(options={"reset_mask": done})`` yourself.
"""

from __future__ import annotations

import functools
import os
import signal
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gymnasium as gym
from gymnasium.utils import seeding

from birdenv.compat import db_dir_argument
from birdenv.envs import MixedTaskEnv, env_groups
from birdenv.interrupts import INTERRUPTS, deliver, interrupts_held
from birdenv.tasks import load_tasks

__all__ = ["BACKENDS", "BIRD_ENV_ID", "ENV_ID", "MixedTaskEnv", "make_vec"]

#: The environment :func:`make_vec` vectorizes by default (debugging tasks).
ENV_ID = "BirdCritic-SQLite-v0"
#: The environment of BIRD text-to-SQL questions.
BIRD_ENV_ID = "BirdSQL-SQLite-v0"
#: Where :func:`make_vec` runs the copies: worker processes, this process, or Ray actors.
BACKENDS = ("async", "sync", "ray")
# Steps per episode when the registration's TimeLimit is not there to say (MixedTaskEnv).
_DEFAULT_MAX_STEPS = 5


def _leaving_ctrl_c_to_the_parent(parent: int, make: Callable[[], gym.Env]) -> gym.Env:
    """Build one copy; in an :class:`~gymnasium.vector.AsyncVectorEnv` worker (a process other
    than ``parent``), first make the worker ignore SIGINT.

    Ctrl-C signals the terminal's whole process group. A worker that raised on it would end on
    its own while its parent unwinds from its own ``KeyboardInterrupt``: the parent's ``close()``
    would then meet a broken pipe in place of the interrupt, and the worker print a traceback.
    The parent ends its workers with ``close()``. The worker starts with the interrupts blocked
    (:func:`make_vec`), so that no Ctrl-C reaches it before it ignores the signal; SIGTERM ends
    it. Gymnasium
    also builds one copy in the parent, to read its spaces: the parent keeps its own SIGINT."""
    if os.getpid() != parent:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # Forked while the parent only noted interrupts (interrupts_held): SIGTERM must end it
        # (Gymnasium's close(terminate=True), a supervisor), not be noted and forgotten.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS)
    return make()


class _WorkerEnvs(gym.vector.AsyncVectorEnv):
    """Gymnasium's :class:`~gymnasium.vector.AsyncVectorEnv`, whose ``close()`` also ends the
    workers when some have died first.

    A job scheduler, ``timeout`` or a supervisor sends SIGTERM to the whole process group: the
    workers end on it at once while the parent unwinds. Gymnasium's ``close()`` would then send a
    dead worker its ``close`` message, and the broken pipe would replace the parent's interrupt.
    Here the workers still alive are terminated instead, and every one is joined: none is left
    behind, and the interrupt goes on."""

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        if any(process.exitcode is not None for process in self.processes):
            terminate = True
        try:
            super().close_extras(timeout=timeout, terminate=terminate)
        except (EOFError, OSError):  # one died while it was asked to close, or in a pending call
            for process in self.processes:
                if process.is_alive():
                    process.terminate()
            for pipe in self.parent_pipes:
                if pipe is not None:
                    pipe.close()
            for process in self.processes:
                process.join()


def _seed_env(env: gym.Env, seed: int | None) -> gym.Env:
    if seed is not None:
        # Seed the task draw now, so that a first ``reset()`` without a seed draws the same tasks
        # as ``reset(seed=seed)`` would (Gymnasium gives copy i the seed ``seed + i``).
        env.unwrapped.np_random, _ = seeding.np_random(seed)
        env.action_space.seed(seed)
        env.observation_space.seed(seed)
    return env


def _make_env(
    env_kwargs: dict[str, Any], seed: int | None, env_id: str = ENV_ID, shipment: Any = None
) -> gym.Env:
    """Build one copy; runs inside the worker process, so sessions and pools are opened there.

    With a :class:`~birdenv.cluster.Shipment` (Ray), the tasks first move to this node's databases.
    """
    if shipment is not None:
        env_kwargs = {**env_kwargs, "tasks": shipment.localize(env_kwargs["tasks"])}
    return _seed_env(gym.make(env_id, **env_kwargs), seed)


def _make_mixed(
    sources: dict[str, Any],
    weights: dict[str, float] | None,
    env_kwargs: dict[str, Any],
    seed: int | None,
    shipment: Any = None,
) -> gym.Env:
    """Build one :class:`MixedTaskEnv` copy (in the worker), with the TimeLimit the envs register."""
    if shipment is not None:
        sources = {name: shipment.localize(tasks) for name, tasks in sources.items()}
    kwargs = dict(env_kwargs)
    steps = kwargs.pop("max_episode_steps", None) or _DEFAULT_MAX_STEPS
    env = gym.wrappers.TimeLimit(MixedTaskEnv(sources, weights, **kwargs), steps)
    if seed is not None:
        # As _seed_env: a first plain reset() draws what reset(seed=seed) would.
        env.unwrapped.np_random, _ = seeding.np_random(seed)
        env.unwrapped._seed_sources()
    return env


def _ship(tasks: list[Any] | dict[str, list[Any]], backend: str) -> Any:
    """With Ray, the :class:`~birdenv.cluster.Shipment` of the databases of ``tasks`` (a list, or
    a mixture's lists by source); else ``None``."""
    if backend != "ray":
        return None
    from birdenv.cluster import ship  # Ray: an optional extra, imported for backend='ray' only

    return ship(
        [t for group in tasks.values() for t in group] if isinstance(tasks, dict) else tasks
    )


def make_vec(
    num_envs: int,
    *,
    suite: str = "critic-mini",
    asynchronous: bool = True,
    backend: str | None = None,
    seed: int | None = None,
    vector_kwargs: dict[str, Any] | None = None,
    mixture: Mapping[str, float] | None = None,
    **env_kwargs: Any,
) -> gym.vector.VectorEnv:
    """``num_envs`` copies of ``BirdCritic-SQLite-v0``, ``BirdSQL-SQLite-v0`` or a mixture of both,
    as one :class:`gymnasium.vector.VectorEnv`.

    Which environment: the one of the tasks' kind and dialect (:func:`birdenv.envs.env_class_for`):
    ``tasks=`` (or a ``suite``: ``critic-mini``, ``critic-mini-pg``, ``bird-mini-eval`` ...) that
    one environment plays gives that env; ``tasks=`` that need several (both kinds, or debugging
    tasks on SQLite and on PostgreSQL), or ``mixture=``, give :class:`MixedTaskEnv` copies.

    Args:
        num_envs: How many copies (trajectories in flight at once).
        suite: The bundled suite to draw tasks from; ignored when ``tasks=`` or ``mixture=`` is
            given.
        asynchronous: One worker process per copy (:class:`~gymnasium.vector.AsyncVectorEnv`,
            ``shared_memory=False``: text cannot go through shared memory) or all in this process
            (:class:`~gymnasium.vector.SyncVectorEnv`); ``backend`` overrides it.
        backend: ``"async"``, ``"sync"`` or ``"ray"``: copies in Ray actors over the cluster at
            ``RAY_ADDRESS``, else a local Ray (:class:`~birdenv.ray_vector.RayVectorEnv`; needs
            the ``ray`` extra). With Ray, tasks are loaded here, on the driver, and each node
            obtains their databases by content hash (:mod:`birdenv.cluster`).
        seed: Copy ``i`` draws its tasks from seed ``seed + i``, exactly as
            ``envs.reset(seed=seed)`` would; the batched spaces are seeded with ``seed``.
        vector_kwargs: Extra arguments for the vector class, e.g. ``context="spawn"``,
            ``autoreset_mode``, or Ray's ``envs_per_actor``, ``step_timeout``, ``actor_options``.
        mixture: Task source → sampling weight, e.g. ``{"gym-mini": 0.7, "bird-mini-train":
            0.3}`` (sources: suite names or files for :func:`birdenv.tasks.load_tasks`). With ``tasks=`` of
            both kinds, the keys are the kinds (``"critic"``, ``"bird"``) and weight the draw
            between them (default: their sizes).
        **env_kwargs: Passed to every copy's env: ``tasks``, ``db_dir`` (``db_root``: its old name),
            ``reward``, ``pool_options``, ``statement_timeout``, ``max_rows``,
            ``max_result_bytes``, ``prompt_options``, ``max_episode_steps`` ...

    Returns:
        The vector environment; ``close()`` it to stop the workers and release their sessions.

    Raises:
        ValueError: ``num_envs`` below 1, an unknown ``backend``, a ``pool=`` object with worker
            processes or Ray (a pool belongs to the process that made it: pass ``pool_options=``
            instead), ``shared_memory=True``, or a mixture that names nothing.
        MissingExtraError: ``backend="ray"`` without Ray installed.
    """
    if num_envs < 1:
        raise ValueError(f"num_envs must be at least 1, got {num_envs}")
    backend = backend or ("async" if asynchronous else "sync")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    kwargs = dict(env_kwargs)
    if "db_root" in kwargs:
        kwargs["db_dir"] = db_dir_argument(kwargs.get("db_dir"), kwargs.pop("db_root"), "make_vec")
    if backend != "sync" and kwargs.get("pool") is not None:
        raise ValueError(
            "a ReplicaPool cannot cross into worker processes; pass pool_options={...} instead "
            "(each worker then opens its own pool with those options on the same root)"
        )
    tasks = kwargs.pop("tasks", None)
    sources: dict[str, Any] | None = None
    weights: dict[str, float] | None = None
    env_id = ENV_ID
    if tasks is None and mixture is None:
        tasks = suite
    if backend == "ray" and (isinstance(tasks, (str, Path)) or tasks is None):
        # Nodes need not see the driver's files: load the tasks here; their databases travel.
        db_dir = kwargs.pop("db_dir", None)
        if tasks is None:
            if not mixture:
                raise ValueError("mixture is empty: name at least one task source")
            sources = {str(name): load_tasks(name, db_dir=db_dir) for name in mixture}
            weights = dict(mixture)
        else:
            tasks = load_tasks(tasks, db_dir=db_dir)
    if isinstance(tasks, (str, Path)) and mixture is None:
        # The environment is the tasks' own (by kind and dialect): read them here to choose it,
        # and let every copy load them by name, as it would anyway.
        groups = env_groups(load_tasks(tasks, db_dir=kwargs.get("db_dir")))
        if len(groups) == 1:
            env_id = next(iter(groups))
        else:
            tasks = [t for group in groups.values() for t in group]
    if tasks is not None and not isinstance(tasks, (str, Path)):
        tasks = list(tasks)
        by_kind: dict[str, list[Any]] = {}
        for task in tasks:
            by_kind.setdefault(task.kind, []).append(task)
        # Several kinds, or one kind in several dialects: MixedTaskEnv copies, one source per kind
        # (each source's env plays its tasks in their own dialects).
        if len(by_kind) > 1 or mixture is not None or len(env_groups(tasks)) > 1:
            sources = by_kind
            weights = None if mixture is None else dict(mixture)
        elif tasks:
            env_id = next(iter(env_groups(tasks)))
    elif mixture is not None and sources is None:
        if not mixture:
            raise ValueError("mixture is empty: name at least one task source")
        sources, weights = {str(name): str(name) for name in mixture}, dict(mixture)
    if sources is not None:
        if weights is not None and set(weights) != set(sources):
            raise ValueError(
                f"mixture names {sorted(weights)} but the tasks hold kinds {sorted(sources)}"
            )
        kwargs.pop("suite", None)
        shipment = _ship(sources, backend)
        fns = [
            functools.partial(
                _make_mixed, sources, weights, kwargs, None if seed is None else seed + i, shipment
            )
            for i in range(num_envs)
        ]
    else:
        kwargs["tasks"] = tasks
        kwargs.pop("suite", None)
        shipment = _ship(tasks, backend)
        fns = [
            functools.partial(
                _make_env, kwargs, None if seed is None else seed + i, env_id, shipment
            )
            for i in range(num_envs)
        ]
    if shipment is not None:
        from birdenv.ray_vector import RayVectorEnv  # Ray: the optional extra, as above

        envs: gym.vector.VectorEnv = RayVectorEnv(
            fns, on_close=shipment.close, **(vector_kwargs or {})
        )
    elif backend == "async":
        options = {"shared_memory": False, **(vector_kwargs or {})}
        if options["shared_memory"]:
            raise ValueError(
                "shared_memory=True returns stale observations for text spaces in Gymnasium "
                "(the shared buffer is decoded once, at construction); leave it False"
            )
        fns = [functools.partial(_leaving_ctrl_c_to_the_parent, os.getpid(), fn) for fn in fns]
        spawning = options.get("context") in ("spawn", "forkserver")
        with interrupts_held(delivered=False, spawning=spawning) as interrupted:
            envs = _WorkerEnvs(fns, **options)
        try:
            deliver(interrupted)
        except BaseException:  # the workers ignore Ctrl-C: closed, they end; the interrupt goes on
            envs.close()
            raise
    else:
        envs = gym.vector.SyncVectorEnv(fns, **(vector_kwargs or {}))
    if seed is not None:
        envs.action_space.seed(seed)
        envs.observation_space.seed(seed)
    return envs


# Moved in 0.2: importable from here, with a warning, for one release.
def _task_kind(task: Any) -> str:
    return task.kind


def _task_category(task: Any) -> str:
    return task.category


_MOVED = {
    "load_source": ("birdenv.tasks.load_tasks", load_tasks),
    "task_kind": ("the task's .kind", _task_kind),
    "task_category": ("the task's .category", _task_category),
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        new, value = _MOVED[name]
        warnings.warn(
            f"birdenv.vector.{name} is deprecated: use {new}", DeprecationWarning, stacklevel=2
        )
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

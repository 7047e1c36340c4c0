"""Vectorized ``BirdCritic-SQLite-v0``: N trajectories at once over one replica store.

:func:`make_vec` builds N copies of the environment, in worker processes
(:class:`gymnasium.vector.AsyncVectorEnv`) or in this one (:class:`gymnasium.vector.SyncVectorEnv`)::

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
from typing import Any

import gymnasium as gym
from gymnasium.utils import seeding

__all__ = ["ENV_ID", "make_vec"]

#: The environment :func:`make_vec` vectorizes.
ENV_ID = "BirdCritic-SQLite-v0"


def _make_env(env_kwargs: dict[str, Any], seed: int | None) -> gym.Env:
    """Build one copy; runs inside the worker process, so sessions and pools are opened there."""
    env = gym.make(ENV_ID, **env_kwargs)
    if seed is not None:
        # Seed the task draw now, so that a first ``reset()`` without a seed draws the same tasks
        # as ``reset(seed=seed)`` would (Gymnasium gives copy i the seed ``seed + i``).
        env.unwrapped.np_random, _ = seeding.np_random(seed)
        env.action_space.seed(seed)
        env.observation_space.seed(seed)
    return env


def make_vec(
    num_envs: int,
    *,
    suite: str = "critic-mini",
    asynchronous: bool = True,
    seed: int | None = None,
    vector_kwargs: dict[str, Any] | None = None,
    **env_kwargs: Any,
) -> gym.vector.VectorEnv:
    """``num_envs`` copies of ``BirdCritic-SQLite-v0`` as one :class:`gymnasium.vector.VectorEnv`.

    Args:
        num_envs: How many copies (trajectories in flight at once).
        suite: The bundled suite to draw tasks from; ignored when ``tasks=`` is given.
        asynchronous: One worker process per copy (:class:`~gymnasium.vector.AsyncVectorEnv`,
            ``shared_memory=False``: text cannot go through shared memory) or all in this process
            (:class:`~gymnasium.vector.SyncVectorEnv`).
        seed: Copy ``i`` draws its tasks from seed ``seed + i``, exactly as
            ``envs.reset(seed=seed)`` would; the batched spaces are seeded with ``seed``.
        vector_kwargs: Extra arguments for the vector class, e.g. ``context="spawn"`` or
            ``autoreset_mode``.
        **env_kwargs: Passed to every copy's ``gymnasium.make``: ``tasks``, ``db_dir``,
            ``reward``, ``pool_options``, ``statement_timeout``, ``max_rows``,
            ``max_result_bytes``, ``max_episode_steps`` ...

    Returns:
        The vector environment; ``close()`` it to stop the workers and release their sessions.

    Raises:
        ValueError: ``num_envs`` below 1, a ``pool=`` object with worker processes (a pool belongs
            to the process that made it: pass ``pool_options=`` instead), or
            ``shared_memory=True``.
    """
    if num_envs < 1:
        raise ValueError(f"num_envs must be at least 1, got {num_envs}")
    kwargs = dict(env_kwargs)
    if kwargs.get("tasks") is None:
        kwargs.pop("tasks", None)
        kwargs["suite"] = suite
    if asynchronous and kwargs.get("pool") is not None:
        raise ValueError(
            "a ReplicaPool cannot cross into worker processes; pass pool_options={...} instead "
            "(each worker then opens its own pool with those options on the same root)"
        )
    fns = [
        functools.partial(_make_env, kwargs, None if seed is None else seed + i)
        for i in range(num_envs)
    ]
    if asynchronous:
        options = {"shared_memory": False, **(vector_kwargs or {})}
        if options["shared_memory"]:
            raise ValueError(
                "shared_memory=True returns stale observations for text spaces in Gymnasium "
                "(the shared buffer is decoded once, at construction); leave it False"
            )
        envs: gym.vector.VectorEnv = gym.vector.AsyncVectorEnv(fns, **options)
    else:
        envs = gym.vector.SyncVectorEnv(fns, **(vector_kwargs or {}))
    if seed is not None:
        envs.action_space.seed(seed)
        envs.observation_space.seed(seed)
    return envs

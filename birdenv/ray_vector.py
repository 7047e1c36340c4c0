"""A :class:`gymnasium.vector.VectorEnv` whose copies live in Ray actors spread over a cluster.

:class:`RayVectorEnv` takes environment builders, as :class:`~gymnasium.vector.SyncVectorEnv` and
:class:`~gymnasium.vector.AsyncVectorEnv` do, and builds them in a few Ray actors (several copies
per actor) placed over the cluster's nodes in proportion to their CPUs. ``reset``, ``step``,
autoreset (all three modes), ``call``, ``get_attr``, ``set_attr`` and ``render`` behave as in
:class:`~gymnasium.vector.SyncVectorEnv`. :func:`birdenv.vector.make_vec` with ``backend="ray"``
builds one over the bundled environments, with their databases sent to each node by content hash.

When an actor dies or does not answer within ``step_timeout``, only its copies suffer: in that
``step`` each of them ends its episode with ``truncated=True``, reward 0, an empty observation and
``info["broken"]`` saying why (in ``infos["final_info"]`` with ``AutoresetMode.SAME_STEP``), the
actor is started again with fresh copies, and the other copies carry on. A ``reset`` is repeated
on the new actor; ``call``/``get_attr``/``set_attr`` raise :class:`~birdenv.errors.ClusterError`.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from birdenv.cluster import START_TIMEOUT, cluster_cpus, connect, placement, spread
from birdenv.errors import ClusterError, WorkerStartError

__all__ = ["RayVectorEnv"]


class _EnvHost:
    """A Ray actor holding some copies of the environment (built here, on its node)."""

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], start: int, count: int) -> None:
        # Every actor receives the one shared list (an object in the store) and builds its slice.
        self.envs = [fn() for fn in env_fns[start : start + count]]

    def describe(self) -> tuple[Any, ...]:
        """The first copy's spaces and metadata, and where this actor runs."""

        # the ray extra: imported only where used
        import ray

        env = self.envs[0]
        node = ray.get_runtime_context().get_node_id()
        return (
            env.observation_space,
            env.action_space,
            env.metadata,
            env.render_mode,
            node,
            os.getpid(),
        )

    def run(self, ops: list[tuple[int, str, Any]]) -> list[tuple[Any, ...]]:
        """Apply each ``(copy, op, argument)``; ops: ``reset``, ``step``, ``step_or_reset``."""
        out: list[tuple[Any, ...]] = []
        for j, op, arg in ops:
            env = self.envs[j]
            if op == "reset":
                seed, options = arg
                out.append(env.reset(seed=seed, options=options))
            elif op == "step":
                out.append(env.step(arg))
            else:  # SAME_STEP: a finished episode starts again in the same step
                obs, reward, terminated, truncated, info = env.step(arg)
                final = None
                if terminated or truncated:
                    final = (obs, info)
                    obs, info = env.reset()
                out.append((obs, reward, terminated, truncated, info, final))
        return out

    def call(self, indices: list[int], name: str, args: tuple, kwargs: dict) -> list[Any]:
        """``name`` of each listed copy: called with the arguments when callable, else read."""
        results = []
        for j in indices:
            attr = self.envs[j].get_wrapper_attr(name)
            results.append(attr(*args, **kwargs) if callable(attr) else attr)
        return results

    def set_attr(self, values: dict[int, Any], name: str) -> None:
        """Set ``name`` on each listed copy."""
        for j, value in values.items():
            self.envs[j].set_wrapper_attr(name, value)

    def close(self) -> None:
        """Close every copy (their sessions are released)."""
        for env in self.envs:
            env.close()


class RayVectorEnv(gym.vector.VectorEnv):
    """Copies of an environment in Ray actors, stepped together like a ``SyncVectorEnv``.

    Args:
        env_fns: One builder per copy; each runs inside its actor, on that actor's node (so open
            sessions and pools inside the env, never in the builder's closure).
        envs_per_actor: Copies per actor (default: spread over one actor per CPU of the cluster).
        step_timeout: Seconds an actor may take to answer one ``reset``/``step``; past it, the
            actor is killed and restarted and its copies' episodes are broken (``None``: wait).
        actor_options: Ray actor options, e.g. ``{"num_cpus": 1}`` (default: the cluster's CPUs
            shared evenly by the actors, at most one each).
        autoreset_mode: As for :class:`~gymnasium.vector.SyncVectorEnv`.
        copy: Return copies of the batched observations (as ``SyncVectorEnv`` does).
        on_close: Called once the actors have stopped (e.g. to stop what serves their data).

    Attributes:
        node_ids: The node of each copy (after restarts, where the copy lives now).
        restarts: Actors started again after they died or hung.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]],
        *,
        envs_per_actor: int | None = None,
        step_timeout: float | None = 600.0,
        actor_options: dict[str, Any] | None = None,
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        copy: bool = True,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._on_close = on_close
        if not env_fns:
            raise ValueError("RayVectorEnv needs at least one environment builder")
        if envs_per_actor is not None and envs_per_actor < 1:
            raise ValueError(f"envs_per_actor must be at least 1, got {envs_per_actor}")
        ray = connect()
        self.num_envs = len(env_fns)
        self.copy = copy
        self.step_timeout = step_timeout
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.restarts = 0
        per_actor = envs_per_actor or math.ceil(self.num_envs / max(1, int(cluster_cpus())))
        # Copy i lives in actor i // per_actor, as its copy i % per_actor.
        self._blocks = [
            list(range(start, min(start + per_actor, self.num_envs)))
            for start in range(0, self.num_envs, per_actor)
        ]
        options = {"num_cpus": min(1.0, cluster_cpus() / len(self._blocks))}
        options.update(actor_options or {})
        self._host, self._actor_options = ray.remote(_EnvHost), options
        self._fns = ray.put(list(env_fns))
        self._nodes = spread(len(self._blocks))
        self._actors: list[Any] = [None] * len(self._blocks)
        self._where: list[tuple[str, int]] = [("", 0)] * len(self._blocks)
        try:
            described = self._start(range(len(self._blocks)))
        except BaseException:
            self.close()
            raise
        obs_space, act_space, metadata, render_mode, _, _ = described[0]
        self.single_observation_space = obs_space
        self.single_action_space = act_space
        self.observation_space = batch_space(obs_space, self.num_envs)
        self.action_space = batch_space(act_space, self.num_envs)
        self.metadata = dict(metadata)
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = render_mode
        self._observations = create_empty_array(obs_space, n=self.num_envs, fn=np.zeros)
        self._env_obs: list[Any] = [None] * self.num_envs
        self._rewards = np.zeros((self.num_envs,), dtype=np.float64)
        self._terminations = np.zeros((self.num_envs,), dtype=np.bool_)
        self._truncations = np.zeros((self.num_envs,), dtype=np.bool_)
        self._autoreset_envs = np.zeros((self.num_envs,), dtype=np.bool_)
        self._broken: dict[int, str] = {}  # copies whose actor was lost since their last step

    # -- actors -----------------------------------------------------------------------------
    def _start(self, indices: Sequence[int]) -> list[tuple[Any, ...]]:
        """Start these actors at once (their copies built anew); wait until each answers."""
        # the ray extra: imported only where used
        import ray

        for a in indices:
            block = self._blocks[a]
            strategy = placement(self._nodes[a])
            self._actors[a] = self._host.options(
                **self._actor_options, scheduling_strategy=strategy
            ).remote(self._fns, block[0], len(block))
        described = []
        for a in indices:
            block = self._blocks[a]
            try:
                described.append(ray.get(self._actors[a].describe.remote(), timeout=START_TIMEOUT))
            except ray.exceptions.GetTimeoutError:
                raise WorkerStartError(
                    f"an actor for copies {block[0]}-{block[-1]} did not start within "
                    f"{START_TIMEOUT:g} s; the cluster has {cluster_cpus():g} CPUs for "
                    f"{len(self._blocks)} actors (lower actor_options['num_cpus'] or use fewer "
                    "actors)"
                ) from None
            except ray.exceptions.RayActorError as exc:
                raise WorkerStartError(
                    f"an actor for copies {block[0]}-{block[-1]} died while it started: {exc}. "
                    "Every node needs bird-rl installed in the same Python as the driver."
                ) from exc
            self._where[a] = (described[-1][4], described[-1][5])
        return described

    def _restart(self, a: int, why: str) -> str:
        """Replace actor ``a`` after it died or hung; returns the message its copies carry."""
        # the ray extra: imported only where used
        import ray

        node, pid = self._where[a]
        with contextlib.suppress(Exception):
            ray.kill(self._actors[a])
        block = self._blocks[a]
        message = (
            f"broken: the Ray actor holding copies {block[0]}-{block[-1]} (node {node[:12]}, "
            f"pid {pid}) {why}; it was restarted and these episodes are lost"
        )
        self._start([a])
        self.restarts += 1
        return message

    def _dispatch(self, ops: dict[int, tuple[str, Any]]) -> tuple[dict[int, Any], dict[int, str]]:
        """Send each actor its copies' ops at once; results by copy, and the actors that failed."""
        # the ray extra: imported only where used
        import ray

        calls = {}
        for a, block in enumerate(self._blocks):
            mine = [(i - block[0], *ops[i]) for i in block if i in ops]
            if mine:
                calls[a] = self._actors[a].run.remote(mine)
        refs = list(calls.values())
        if not refs:
            return {}, {}
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.step_timeout)
        results: dict[int, Any] = {}
        failed: dict[int, str] = {}
        for a, ref in calls.items():
            if ref not in ready:
                failed[a] = f"did not answer within step_timeout={self.step_timeout:g} s"
                continue
            try:
                answers = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                failed[a] = f"died ({type(exc).__name__})"
                continue
            except ray.exceptions.RayTaskError:
                # The environment itself raised, as it would in a SyncVectorEnv: so does this.
                raise
            targets = [i for i in self._blocks[a] if i in ops]
            results.update(zip(targets, answers, strict=True))
        return results, failed

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The Ray node of each copy."""
        return tuple(self._where[a][0] for a, block in enumerate(self._blocks) for _ in block)

    @property
    def actor_pids(self) -> tuple[int, ...]:
        """The process id of the actor holding each copy (on its node)."""
        return tuple(self._where[a][1] for a, block in enumerate(self._blocks) for _ in block)

    # -- the VectorEnv API ------------------------------------------------------------------
    def reset(
        self,
        *,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every copy, or those of ``options["reset_mask"]``, as ``SyncVectorEnv`` does."""
        if seed is None:
            seed = [None] * self.num_envs
        elif isinstance(seed, int):
            seed = [seed + i for i in range(self.num_envs)]
        if len(seed) != self.num_envs:
            raise ValueError(
                f"If seeds are passed as a list the length must match num_envs={self.num_envs} "
                f"but got length={len(seed)}."
            )
        options = dict(options) if options is not None else None
        mask = np.ones(self.num_envs, dtype=np.bool_)
        if options is not None and "reset_mask" in options:
            mask = options.pop("reset_mask")
            if not isinstance(mask, np.ndarray):
                raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
            if mask.shape != (self.num_envs,):
                raise ValueError(
                    f"`options['reset_mask']` must have shape `({self.num_envs},)`, got {mask.shape}"
                )
            if mask.dtype != np.bool_:
                raise TypeError(
                    f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}"
                )
            if not np.any(mask):
                raise ValueError(
                    "`options['reset_mask']` must contain a boolean array with at least one True "
                    f"value, got reset_mask={mask}"
                )
        ops = {int(i): ("reset", (seed[i], options)) for i in np.flatnonzero(mask)}
        results, failed = self._dispatch(ops)
        if failed:
            # A reset loses nothing yet: repeat it on the new actor. Its other copies' episodes
            # are lost; they say so at their next step.
            for a, why in failed.items():
                message = self._restart(a, why)
                for i in self._blocks[a]:
                    if i not in ops:
                        self._broken[i] = message
            retry = {i: op for i, op in ops.items() if i not in results}
            again, still = self._dispatch(retry)
            if still:
                for a, why in still.items():
                    self._restart(a, why)
                raise ClusterError(
                    f"reset failed twice: the actors of copies "
                    f"{sorted(i for a in still for i in self._blocks[a])} {'; '.join(still.values())}"
                )
            results.update(again)
        self._terminations[mask] = False
        self._truncations[mask] = False
        self._autoreset_envs[mask] = False
        infos: dict[str, Any] = {}
        for i in sorted(results):
            self._broken.pop(i, None)
            self._env_obs[i], env_info = results[i]
            infos = self._add_info(infos, env_info, i)
        self._observations = concatenate(
            self.single_observation_space, self._env_obs, self._observations
        )
        return (deepcopy(self._observations) if self.copy else self._observations), infos

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every copy (or autoreset it), as ``SyncVectorEnv`` does; lost copies truncate."""
        actions = list(iterate(self.action_space, actions))
        same_step = self.autoreset_mode == AutoresetMode.SAME_STEP
        ops: dict[int, tuple[str, Any]] = {}
        lost: dict[int, str] = {}
        for i, action in enumerate(actions):
            if self.autoreset_mode == AutoresetMode.NEXT_STEP and self._autoreset_envs[i]:
                self._broken.pop(i, None)  # its episode had ended: nothing is lost
                ops[i] = ("reset", (None, None))
            elif i in self._broken:
                lost[i] = self._broken.pop(i)
                if same_step:
                    ops[i] = ("reset", (None, None))
            else:
                if self.autoreset_mode == AutoresetMode.DISABLED:
                    assert not self._autoreset_envs[i], f"{self._autoreset_envs=}"
                ops[i] = ("step_or_reset" if same_step else "step", action)
        results, failed = self._dispatch(ops)
        for a, why in failed.items():
            message = self._restart(a, why)
            for i in self._blocks[a]:
                lost[i] = message
        if same_step and failed:
            # The lost copies start again now, on their new actor, as SAME_STEP requires.
            again, still = self._dispatch(
                {i: ("reset", (None, None)) for a in failed for i in self._blocks[a]}
            )
            if still:
                raise ClusterError(f"restarted actors failed again: {'; '.join(still.values())}")
            results.update(again)
        infos: dict[str, Any] = {}
        for i in range(self.num_envs):
            if i in lost:
                self._rewards[i], self._terminations[i], self._truncations[i] = 0.0, False, True
                if same_step:
                    self._env_obs[i], env_info = results[i]
                    infos = self._add_info(
                        infos, {"final_obs": "", "final_info": {"broken": lost[i]}}, i
                    )
                else:
                    self._env_obs[i], env_info = "", {"broken": lost[i]}
            elif ops[i][0] == "reset":
                self._env_obs[i], env_info = results[i]
                self._rewards[i], self._terminations[i], self._truncations[i] = 0.0, False, False
            else:
                obs, reward, terminated, truncated, env_info, *final = results[i]
                self._env_obs[i], self._rewards[i] = obs, reward
                self._terminations[i], self._truncations[i] = terminated, truncated
                if final and final[0] is not None:
                    infos = self._add_info(
                        infos, {"final_obs": final[0][0], "final_info": final[0][1]}, i
                    )
            infos = self._add_info(infos, env_info, i)
        self._observations = concatenate(
            self.single_observation_space, self._env_obs, self._observations
        )
        self._autoreset_envs = np.logical_or(self._terminations, self._truncations)
        return (
            deepcopy(self._observations) if self.copy else self._observations,
            np.copy(self._rewards),
            np.copy(self._terminations),
            np.copy(self._truncations),
            infos,
        )

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """``name`` of every copy: called with the arguments when it is a method, else read."""
        # the ray extra: imported only where used
        import ray

        refs = [
            actor.call.remote(list(range(len(block))), name, args, kwargs)
            for actor, block in zip(self._actors, self._blocks, strict=True)
        ]
        return tuple(x for part in self._gather(ray, refs) for x in part)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """The attribute ``name`` of every copy."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Set ``name`` on every copy: one value each (a list or tuple), or the same for all."""
        # the ray extra: imported only where used
        import ray

        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(
                "Values must be a list or tuple with length equal to the number of environments. "
                f"Got `{len(values)}` values for {self.num_envs} environments."
            )
        refs = [
            actor.set_attr.remote({i - block[0]: values[i] for i in block}, name)
            for actor, block in zip(self._actors, self._blocks, strict=True)
        ]
        self._gather(ray, refs)

    def _gather(self, ray: Any, refs: list[Any]) -> list[Any]:
        """Every actor's answer; an actor that died or hung is restarted, then ClusterError."""
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.step_timeout)
        answers, failed = [], {}
        for a, ref in enumerate(refs):
            if ref not in ready:
                failed[a] = f"did not answer within step_timeout={self.step_timeout:g} s"
                continue
            try:
                answers.append(ray.get(ref))
            except ray.exceptions.RayActorError as exc:
                failed[a] = f"died ({type(exc).__name__})"
            except ray.exceptions.RayTaskError:
                raise
        for a, why in failed.items():
            message = self._restart(a, why)
            for i in self._blocks[a]:
                self._broken[i] = message
        if failed:
            raise ClusterError("; ".join(self._broken[self._blocks[a][0]] for a in failed))
        return answers

    def render(self) -> tuple[Any, ...]:
        """Every copy's ``render()``."""
        return self.call("render")

    def close_extras(self, **kwargs: Any) -> None:
        """Close every copy (releasing its sessions), then stop the actors."""
        # the ray extra: imported only where used
        import ray

        actors = [a for a in self._actors if a is not None]
        with contextlib.suppress(Exception):
            ray.wait([a.close.remote() for a in actors], num_returns=len(actors), timeout=30)
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self._actors = [None] * len(self._blocks)
        if self._on_close is not None:
            self._on_close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self.closed:
                self.close()

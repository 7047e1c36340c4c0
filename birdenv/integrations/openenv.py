"""OpenEnv: the environments served over HTTP and WebSocket with ``openenv-core``'s ``create_app``.

``birdenv serve`` runs :func:`make_app` under uvicorn. Each WebSocket connection (``/ws``, what
OpenEnv's ``EnvClient`` speaks) gets its own :class:`BirdOpenEnv`, and each of its episodes one
database session:

- concurrent sessions are on, up to ``max_sessions`` (a connection past it is refused with
  OpenEnv's capacity error);
- a session idle for ``idle_timeout`` seconds is closed by OpenEnv's reaper, which frees its
  replica lease (a client that vanished holds nothing for long);
- OpenEnv's plain HTTP ``POST /step`` makes a fresh environment per request, so it has no
  episode: it answers 409 with a message that says to use the WebSocket, never a 500;
- the action is the model's turn in one field, ``text`` (the Gymnasium action); the observation
  declares ``text`` (the prompt or the tool's response), ``verdict`` and ``task_id``;
- ``GET /birdenv/pool`` reports the replica pool's open sessions (leases) and OpenEnv's active
  sessions, to check that nothing leaks.

The server binds 127.0.0.1 unless told otherwise. :class:`BirdEnvClient` is OpenEnv's client for
it; :class:`BirdOpenEnvTRLEnv` wraps that client for TRL's ``environment_factory``.
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from birdenv import tools
from birdenv.errors import BirdEnvError
from birdenv.integrations.trajectory import Trajectory, task_list
from birdenv.integrations.trl import TRLTools
from birdenv.interrupts import INTERRUPTS
from birdenv.replicas import ReplicaPool
from birdenv.replicas.pool import default_pool

# openenv-core's package imports its Gradio web interface whenever gradio is installed (it is one
# of its requirements): 6 of the 9 CPU-s this module took to import, in every server and client
# process, for a page that ``birdenv serve`` never mounts (OpenEnv mounts it only under
# ENABLE_WEB_INTERFACE=true, and then imports it itself, gradio included). While OpenEnv loads,
# gradio reads as not installed, which OpenEnv's package handles by leaving that page out. A
# process that has already imported gradio keeps it.
_GRADIO_HIDDEN = "gradio" not in sys.modules
if _GRADIO_HIDDEN:
    sys.modules["gradio"] = None  # type: ignore[assignment]  # import gradio: ModuleNotFoundError
try:
    from openenv.core.client_types import StepResult
    from openenv.core.env_client import EnvClient
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, ConcurrencyConfig, Observation, State
finally:
    if _GRADIO_HIDDEN and sys.modules.get("gradio", False) is None:
        del sys.modules["gradio"]

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_SESSIONS",
    "BirdAction",
    "BirdEnvClient",
    "BirdObservation",
    "BirdOpenEnv",
    "BirdOpenEnvTRLEnv",
    "BirdState",
    "NoEpisodeError",
    "make_app",
    "serve",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MAX_SESSIONS = 64
#: Seconds a WebSocket session may stay silent before its session is closed and its lease freed.
DEFAULT_IDLE_TIMEOUT = 300.0


class NoEpisodeError(BirdEnvError):
    """A step with no episode: on plain HTTP (stateless in OpenEnv), or before ``reset``."""


class BirdAction(Action):
    """The model's turn: free text holding one tool call, as the Gymnasium action."""

    text: str = Field(..., description="The model's turn, holding exactly one <tool_call>.")


class BirdObservation(Observation):
    """The prompt (after reset) or the tool's response, with the verdict once judged."""

    text: str = Field(
        default="", description="The user prompt after reset; the tool's response after a step."
    )
    verdict: dict[str, Any] | None = Field(
        default=None, description="The judge's verdict once a submission was judged, else null."
    )
    task_id: str | None = Field(default=None, description="The episode's task.")


class BirdState(State):
    """OpenEnv's state plus the episode's task."""

    task_id: str | None = Field(default=None, description="The episode's task.")


class BirdOpenEnv(Environment[BirdAction, BirdObservation, BirdState]):
    """One WebSocket session: a :class:`~birdenv.integrations.trajectory.Trajectory` per
    connection, one episode (and one database session) at a time.

    ``reset(task_id=..., seed=...)`` starts an episode; ``step(BirdAction(text=...))`` plays a turn.
    Keyword arguments are the trajectory's (``kind``, ``tasks``, ``max_turns``, ``pool`` ...).
    """

    SUPPORTS_CONCURRENT_SESSIONS = True
    #: The sessions open in this process (:func:`serve` closes them when it stops).
    open: ClassVar[weakref.WeakSet[BirdOpenEnv]] = weakref.WeakSet()

    def __init__(self, **trajectory_kwargs: Any) -> None:
        super().__init__()
        self.trajectory = Trajectory(**trajectory_kwargs)
        self._state = BirdState()
        BirdOpenEnv.open.add(self)

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        task_id: str | None = None,
        **kwargs: Any,
    ) -> BirdObservation:
        """Start an episode on ``task_id`` (else a task drawn with ``seed``)."""
        prompt = self.trajectory.start(task_id, seed=seed)
        task = str(self.trajectory.task.instance_id)
        self._state = BirdState(episode_id=episode_id, step_count=0, task_id=task)
        return BirdObservation(text=prompt, task_id=task, done=False, reward=0.0)

    def step(
        self, action: BirdAction, timeout_s: float | None = None, **kwargs: Any
    ) -> BirdObservation:
        """Play the turn; a malformed call is an error observation."""
        if self.trajectory.task is None:
            raise NoEpisodeError(
                "no episode: reset first. OpenEnv's HTTP /step is stateless (a fresh environment "
                "per request); play episodes over the WebSocket /ws (EnvClient)"
            )
        turn = self.trajectory.turn(action.text)
        self._state.step_count += 1
        return BirdObservation(
            text=turn.observation,
            verdict=turn.verdict,
            task_id=self._state.task_id,
            done=turn.done,
            reward=turn.reward,
        )

    @property
    def state(self) -> BirdState:
        """The episode id, the steps taken and the task."""
        return self._state

    def close(self) -> None:
        """Free the session (OpenEnv calls this on disconnect and when the idle reaper fires)."""
        BirdOpenEnv.open.discard(self)
        self.trajectory.close()


def make_app(
    kind: str = "critic",
    *,
    suite: str | None = None,
    tasks: str | Path | None = None,
    db_dir: str | Path | None = None,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
    max_turns: int | None = None,
    pool: ReplicaPool | None = None,
    **env_kwargs: Any,
) -> FastAPI:
    """The OpenEnv application for ``kind``'s tasks (``suite``, or ``tasks`` with ``db_dir``).

    ``max_sessions`` WebSocket sessions at once; ``idle_timeout`` seconds of silence close one
    (None: never); ``max_turns`` is the episode's turn limit; ``pool`` the replica pool (default:
    the process's); other keywords (``reward``, ``statement_timeout`` ...) go to the environment.
    """
    if max_sessions < 1:
        raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
    if idle_timeout is not None and idle_timeout <= 0:
        raise ValueError(f"idle_timeout must be positive (or None), got {idle_timeout}")
    pool = pool or default_pool()
    factory = functools.partial(
        BirdOpenEnv,
        kind=kind,
        tasks=task_list(kind, suite=suite, tasks=tasks, db_dir=db_dir),  # loaded once, shared
        max_turns=max_turns,
        pool=pool,
        **env_kwargs,
    )
    # OpenEnv names a factory that failed by its __name__, else by its repr: a partial's repr
    # holds every task, solutions and tests included, and the name goes to the client.
    factory.__name__ = BirdOpenEnv.__name__  # type: ignore[attr-defined]
    app = create_app(
        factory,
        BirdAction,
        BirdObservation,
        env_name="birdenv",
        concurrency_config=ConcurrencyConfig(
            max_concurrent_envs=max_sessions, session_timeout=idle_timeout
        ),
    )

    @app.exception_handler(NoEpisodeError)
    async def _no_episode(request: Request, exc: NoEpisodeError) -> JSONResponse:
        return JSONResponse(status_code=409, content={"detail": str(exc)})

    @app.get("/birdenv/pool", tags=["birdenv"])
    def _pool() -> dict[str, Any]:
        """The open sessions (replica leases, and PostgreSQL clones leased from the process's
        database pool) and the replica pool's peak; nothing leaked reads 0 when idle."""
        # the postgres extra (psycopg): imported only where used
        from birdenv.postgres.pool import current_database_pool

        stats = pool.stats()
        databases = current_database_pool()
        clones = 0 if databases is None else databases.stats()["leased"]
        return {
            "open_sessions": stats["open_sessions"] + clones,
            "peak_sessions": stats["peak_sessions"],
        }

    return app


def _not_a_disconnect(record: logging.LogRecord) -> bool:
    """A log record that is not a WebSocket's disconnect reported as an error."""
    # the openenv extra: imported only where used
    from starlette.websockets import WebSocketDisconnect

    return not (record.exc_info and isinstance(record.exc_info[1], WebSocketDisconnect))


def serve(
    host: str = DEFAULT_HOST,
    port: int = 8000,
    *,
    ready: Callable[[], None] | None = None,
    **app_kwargs: Any,
) -> int | None:
    """Serve :func:`make_app` (``app_kwargs``) with uvicorn on ``host:port`` until SIGINT or
    SIGTERM; return the signal that stopped it (None: stopped otherwise).

    ``ready()`` is called once the port accepts connections. On the way out every open session is
    closed, so its database (a replica, a PostgreSQL clone) is dropped; the process's exit hooks
    then drop the pools' ready clones and stop the private PostgreSQL cluster if this process was
    its last user. (uvicorn re-raises the signal that stopped it once it has shut down: with
    SIGTERM's default action the process would end there, its exit hooks skipped and the cluster
    left running; the signal is noted here instead.)"""
    # the openenv extra: imported only where used
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and ready is not None:
                ready()

    server = Server(
        uvicorn.Config(make_app(**app_kwargs), host=host, port=port, log_level="warning")
    )
    # OpenEnv's WebSocket handler closes, on its way out, a socket the shutdown already closed,
    # and starlette raises WebSocketDisconnect for it: uvicorn would print that as a traceback.
    logging.getLogger("uvicorn.error").addFilter(_not_a_disconnect)
    stopped: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _: stopped.append(s)) for sig in INTERRUPTS}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for env in list(BirdOpenEnv.open):
            env.close()
    return stopped[0] if stopped else None


class BirdEnvClient(EnvClient[BirdAction, BirdObservation, BirdState]):
    """OpenEnv's WebSocket client for ``birdenv serve``: one server session per client.

    .. code-block:: python

        with BirdEnvClient(base_url="http://127.0.0.1:8000").sync() as env:
            prompt = env.reset(task_id="shop_1").observation.text
            result = env.step(BirdAction(text=model_turn))
    """

    def _step_payload(self, action: BirdAction) -> dict[str, Any]:
        return {"text": action.text}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[BirdObservation]:
        observation = BirdObservation(
            **payload.get("observation", {}),
            done=payload.get("done", False),
            reward=payload.get("reward"),
        )
        return StepResult(
            observation=observation, reward=payload.get("reward"), done=observation.done
        )

    def _parse_state(self, payload: dict[str, Any]) -> BirdState:
        return BirdState(**payload)


class BirdOpenEnvTRLEnv(TRLTools):
    """TRL's ``environment_factory`` over a ``birdenv serve`` server: one connection per env.

    ``functools.partial(BirdOpenEnvTRLEnv, base_url="http://127.0.0.1:8000")`` is the factory;
    TRL calls ``reset(**row)`` (the row's ``task_id``), exposes ``execute_sql`` and
    ``submit_solution`` as tools (their schemas are birdenv's) and reads ``get_reward()``. The
    connection closes when the environment is dropped (TRL closes none; the server then frees
    the session): a public ``close`` would be a third tool.
    """

    def __init__(self, base_url: str) -> None:
        self.client = BirdEnvClient(base_url=base_url).sync()
        self.client.connect()
        self.reward = 0.0
        weakref.finalize(self, self.client.close)

    def reset(self, **row: Any) -> str:
        """Start the rollout on the row's task (``task_id``; else one drawn at random)."""
        task_id = row.get("task_id")
        result = self.client.reset(**({"task_id": task_id} if task_id else {}))
        self.reward = 0.0
        return result.observation.text

    def _call(self, name: str, **arguments: Any) -> str:
        result = self.client.step(BirdAction(text=tools.format_tool_call(name, **arguments)))
        if result.done:
            self.reward = float(result.reward or 0.0)
        return result.observation.text

"""verl: the two tools as ``BaseTool``s with one session per rollout, and an agent loop that ends it.

verl's ``ToolAgentLoop`` runs ``create`` → ``execute`` → ``release`` on *every* tool call, so a tool
object keeps no state of its own across turns. :class:`BirdSQLTool` keeps it elsewhere: every call
of one rollout finds the same :class:`~birdenv.integrations.trajectory.Trajectory` (one database
session) under the rollout's ``request_id``, opened on its first tool call from the task id in
the row's ``tools_kwargs``. :class:`BirdToolAgentLoop` (registered as ``birdenv_tool_agent``) is
verl's ``ToolAgentLoop`` plus three things: the rollout ends when the episode does (a submission,
or the environment's turn limit); whatever ends the rollout (that, the model stopping, the length
limit, cancellation, an exception) it closes the trajectory in a ``finally``, freeing the session;
and it sets the rollout's ``reward_score`` from the judge's verdict, so verl needs no reward
function. SQLite work runs in a worker thread (``asyncio.to_thread``), never on the event
loop that serves every rollout of the worker.

The YAML files verl reads and the command line are in ``examples/verl/``; :func:`verl_rows`
builds the dataset rows (prompt, ``agent_name``, ``tools_kwargs``).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from pathlib import Path
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from birdenv.integrations.trajectory import Trajectory, task_list
from birdenv.tools import TOOL_SCHEMAS

__all__ = ["AGENT_NAME", "BirdSQLTool", "BirdToolAgentLoop", "open_trajectories", "verl_rows"]

#: The name :class:`BirdToolAgentLoop` is registered under (a row's ``agent_name``).
AGENT_NAME = "birdenv_tool_agent"

_SCHEMAS = {schema["function"]["name"]: schema for schema in TOOL_SCHEMAS}
# Keys of a tool's YAML ``config`` that choose the trajectory; the rest go to the environment.
_RESERVED = ("type", "name")

# request_id -> the rollout's trajectory. verl keeps one tool object per tool and worker process,
# shared by every rollout the worker runs; both tools of a rollout must see the same session.
_trajectories: dict[str, Trajectory] = {}
# Rollouts ended lately: a tool call still queued in a thread when its rollout was cancelled
# must not open a session nobody would close. Bounded: the window is one call's queueing.
_ended: collections.OrderedDict[str, None] = collections.OrderedDict()
_ENDED_KEPT = 4096
_lock = threading.Lock()


def open_trajectories() -> int:
    """How many rollouts of this process hold a trajectory (a database session) now."""
    with _lock:
        return len(_trajectories)


def _schema(name: str) -> dict[str, Any]:
    """The tool's schema in verl's form: birdenv's one schema without its ``return`` entry."""
    function = {k: v for k, v in _SCHEMAS[name]["function"].items() if k != "return"}
    return {"type": "function", "function": function}


class BirdSQLTool(BaseTool):
    """``execute_sql`` or ``submit_solution`` (the tool YAML's ``config.name``) for verl.

    ``config`` holds ``type: native``, ``name``, and the trajectory's settings: ``kind``
    (``critic`` or ``bird``), ``suite`` or ``tasks`` with ``db_dir``, ``max_turns``, ``reward``,
    ``statement_timeout`` ... (:class:`~birdenv.integrations.trajectory.Trajectory`). Give both
    tools the same settings. A row's ``tools_kwargs`` name the task:
    ``{"execute_sql": {"create_kwargs": {"task_id": ...}}, ...}`` (:func:`verl_rows` writes them).
    """

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        name = config.get("name", tool_schema.function.name if tool_schema else None)
        if name not in _SCHEMAS:
            raise ValueError(f"config.name must be one of {sorted(_SCHEMAS)}, got {name!r}")
        self.settings = {k: v for k, v in config.items() if k not in _RESERVED}
        super().__init__(
            config, tool_schema or OpenAIFunctionToolSchema.model_validate(_schema(name))
        )
        # create() is called with the row's create_kwargs but no request id: keep them until the
        # same call's execute() names the rollout.
        self._pending: dict[str, dict[str, Any]] = {}

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        """Note the row's ``create_kwargs`` for this call (the task id); no session is opened."""
        instance_id = instance_id or uuid4().hex
        self._pending[instance_id] = dict(kwargs.get("create_kwargs") or {})
        return instance_id, ToolResponse()

    def _trajectory(self, request_id: str, create_kwargs: dict[str, Any]) -> Trajectory:
        # Opened and started under the lock: a parallel call of the same rollout waits for it
        # rather than finding a trajectory not started yet.
        with _lock:
            if request_id in _ended:
                raise RuntimeError(f"rollout {request_id} has ended; its session is closed")
            trajectory = _trajectories.get(request_id)
            if trajectory is None:
                trajectory = Trajectory(**self.settings)
                try:
                    trajectory.start(create_kwargs.get("task_id"))
                except BaseException:
                    trajectory.close()
                    raise
                _trajectories[request_id] = trajectory
        return trajectory

    def _run(self, request_id: str, create_kwargs: dict[str, Any], parameters: dict) -> Any:
        return self._trajectory(request_id, create_kwargs).call(self.name, parameters)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        """Run the call on the rollout's session in a worker thread; the observation is the text.

        A malformed call (a missing or wrong argument) or a failing statement is an error
        observation; the tool reward is 0.0 (the rollout's reward is the verdict, set by
        :class:`BirdToolAgentLoop`).
        """
        agent_data = kwargs.get("agent_data")
        if agent_data is None:
            raise TypeError(f"{self.name}: verl passes agent_data=...; it is what keys the rollout")
        create_kwargs = self._pending.get(instance_id, {})
        turn = await asyncio.to_thread(
            self._run, str(agent_data.request_id), create_kwargs, dict(parameters)
        )
        return ToolResponse(text=turn.observation), 0.0, {"done": turn.done, "passed": turn.passed}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Forget this call's ``create_kwargs``; the rollout's session stays open for its next call."""
        self._pending.pop(instance_id, None)


async def _close_trajectory(request_id: str) -> Trajectory | None:
    """End the rollout's trajectory and free its session (in a worker thread); return it, or None
    if the rollout never called a tool."""
    with _lock:
        trajectory = _trajectories.pop(request_id, None)
        _ended[request_id] = None
        if len(_ended) > _ENDED_KEPT:
            _ended.popitem(last=False)
    if trajectory is not None:
        await asyncio.to_thread(trajectory.close)
    return trajectory


@register(AGENT_NAME)
class BirdToolAgentLoop(ToolAgentLoop):
    """verl's ``ToolAgentLoop`` whose rollout owns one birdenv session from its first tool call to
    its end, and whose reward is the verdict (0.0 when nothing was submitted)."""

    def _make_request_id(self, priority: int, full_determinism: bool) -> str:
        # The id verl gives this rollout (and the tools see as agent_data.request_id), kept so the
        # finally below can find the rollout's session whatever ends it.
        request_id = ToolAgentLoop._make_request_id(priority, full_determinism)
        with _lock:  # ids repeat across steps under full determinism ("det-{priority}")
            _ended.pop(request_id, None)
        self._birdenv_request_id = request_id
        return request_id

    async def _handle_processing_tools_state(self, agent_data: AgentData) -> AgentState:
        # After the tools ran: a submission (or the turn limit) ended the episode, so the rollout
        # ends too, as a Gymnasium episode terminates; the model is not asked for another turn.
        state = await super()._handle_processing_tools_state(agent_data)
        with _lock:
            trajectory = _trajectories.get(str(agent_data.request_id))
        return AgentState.TERMINATED if trajectory is not None and trajectory.done else state

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """verl's tool loop; then the session is freed and the reward set from the verdict."""
        self._birdenv_request_id = None
        trajectory = None
        try:
            output = await super().run(sampling_params, **kwargs)
        finally:
            if self._birdenv_request_id is not None:
                # shield: a cancelled rollout still frees its session before it unwinds.
                trajectory = await asyncio.shield(_close_trajectory(self._birdenv_request_id))
        output.reward_score = trajectory.reward if trajectory is not None else 0.0
        output.extra_fields["verdict"] = trajectory.verdict if trajectory is not None else None
        return output


def verl_rows(
    kind: str = "critic",
    *,
    suite: str | None = None,
    tasks: str | Path | list[Any] | None = None,
    db_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """verl dataset rows (``RLHFDataset``'s fields) for every task, in order: the environment's
    prompt as the user message, ``agent_name`` :data:`AGENT_NAME`, and ``extra_info`` with the
    task id in both tools' ``tools_kwargs``. Write them with ``pandas.DataFrame(rows).to_parquet``.
    """
    trajectory = Trajectory(kind, tasks=task_list(kind, suite=suite, tasks=tasks, db_dir=db_dir))
    rows = []
    try:
        for index, task_id in enumerate(trajectory.task_ids):
            prompt = trajectory.start(task_id)
            create = {"create_kwargs": {"task_id": task_id}}
            rows.append(
                {
                    "data_source": f"birdenv/{kind}",
                    "prompt": [{"role": "user", "content": prompt}],
                    "agent_name": AGENT_NAME,
                    "reward_model": {"style": "rule", "ground_truth": task_id},
                    "extra_info": {
                        "index": index,
                        "task_id": task_id,
                        "tools_kwargs": {name: create for name in _SCHEMAS},
                    },
                }
            )
    finally:
        trajectory.close()
    return rows

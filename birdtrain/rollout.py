"""Multi-turn rollouts of a policy over any ``gymnasium.vector.VectorEnv`` of the birdenv envs.

:func:`collect` runs ``num_generations`` rollouts of every task through a vector environment
(:class:`~gymnasium.vector.SyncVectorEnv`, :class:`~gymnasium.vector.AsyncVectorEnv`, one a user
builds, e.g. with :func:`birdenv.vector.make_vec`), one copy of the environment per rollout in
flight, and returns one :class:`Episode` per rollout with its exact token accounting::

    prompt_ids  = template([user prompt], tools, add_generation_prompt=True)
    completion  = turn 1 (model, mask 1) + tool block 1 (template, mask 0) + turn 2 (model, mask 1) ...

The tokens of turn k are the ones the model sampled, never re-tokenized; the tokens between two
turns are what the chat template adds for the tool message (closing the assistant turn, the tool
response, opening the next assistant turn). Training sees exactly the ids the policy generated from.

:class:`Episode` is also the record of evaluation episodes (reference agents, endpoints) and of
the trajectory store. The policies live in :mod:`birdtrain.policies`.

Scheduling: every copy of the vector env is a *slot* (:class:`Scheduler`). A free slot is reset
explicitly on its next rollout's task (``reset(options={"task_id": ..., "reset_mask": ...})``);
every step carries the model's turns, and an empty turn to slots without work. The vector env must
be built with ``autoreset_mode=AutoresetMode.DISABLED`` (:data:`AUTORESET_MODE`; ``make_vec(...,
vector_kwargs=VECTOR_KWARGS)``): nothing then resets a copy behind the loop's back, so a turn
is never swallowed by an autoreset (with ``NEXT_STEP``, Gymnasium 1.4's ``AsyncVectorEnv`` keeps a
worker's pending autoreset across an explicit ``reset``), and a copy whose episode ended is reset
before it is stepped again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from birdenv.tools import TOOL_SCHEMAS, ToolCallError, has_tool_call, parse_tool_call
from birdtrain.policies import Policy
from birdtrain.timeline import Timeline

__all__ = [
    "AUTORESET_MODE",
    "VECTOR_KWARGS",
    "Episode",
    "Rollouts",
    "Scheduler",
    "Segment",
    "collect",
    "prompt_ids",
    "submitted",
    "tool_suffix_ids",
]

#: The one autoreset mode :func:`collect` steps vector envs in: copies are reset only explicitly.
AUTORESET_MODE = gym.vector.AutoresetMode.DISABLED
#: ``vector_kwargs`` for :func:`birdenv.vector.make_vec` that build a vector env :func:`collect` takes.
VECTOR_KWARGS = {"autoreset_mode": AUTORESET_MODE}

# Replaces an assistant turn's content while rendering the chat template, to find where the
# template's own text around that turn begins and ends.
_SENTINEL = "\u2063BIRDRL-TURN-SENTINEL\u2063"


@dataclasses.dataclass
class Segment:
    """A run of completion tokens: the model's own turn (``generated``) or template/tool text."""

    ids: list[int]
    generated: bool
    logprobs: list[float]


@dataclasses.dataclass
class Episode:
    """One episode of a task: its conversation, token accounting, outcome and timings.

    ``group`` numbers the episodes of one task (the GRPO group; the sample of pass@k).
    ``dropped`` is True only when the episode *broke* (an environment or worker error): it must
    contribute nothing to training. Running out of turns or context is an ordinary truncation
    (``truncated``, reward 0) and is kept. Episodes of policies that do not generate tokens here
    (reference agents, endpoints) have no ``prompt_ids`` or ``segments``. ``pred_sqls`` is the
    submission (see :func:`submitted`) once an evaluation has read it.
    """

    task_id: str
    group: int = 0
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    segments: list[Segment] = dataclasses.field(default_factory=list)
    messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    verdict: dict[str, Any] | None = None
    tool_calls: int = 0
    invalid_calls: int = 0
    turns: int = 0
    truncated: bool = False
    dropped: bool = False
    error: str | None = None
    generation_s: float = 0.0
    env_s: float = 0.0
    statement_s: list[float | None] = dataclasses.field(default_factory=list)
    pred_sqls: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Episode:
        """The episode that ``dataclasses.asdict`` gave ``row``."""
        return cls(**{**row, "segments": [Segment(**s) for s in row.get("segments", ())]})

    @property
    def completion_ids(self) -> list[int]:
        """All tokens after the prompt: model turns and the template text between them."""
        return [t for s in self.segments for t in s.ids]

    @property
    def mask(self) -> list[int]:
        """1 for tokens the model generated, 0 for prompt/tool-response tokens from the template."""
        return [int(s.generated) for s in self.segments for _ in s.ids]

    @property
    def logprobs(self) -> list[float]:
        """Sampling logprob of each completion token (0.0 on template tokens)."""
        return [lp for s in self.segments for lp in s.logprobs]

    @property
    def passed(self) -> bool:
        """True when the judge accepted the submission."""
        return bool(self.verdict and self.verdict.get("status") == "success")

    @property
    def context_length(self) -> int:
        """Tokens in the context so far (prompt + completion)."""
        return len(self.prompt_ids) + sum(len(s.ids) for s in self.segments)

    @property
    def turn_tokens(self) -> list[int]:
        """Tokens the policy generated in each turn (empty when it generated none here)."""
        return [len(s.ids) for s in self.segments if s.generated]


def submitted(messages: list[dict[str, Any]]) -> list[str]:
    """The ``sql_list`` of a conversation's submission, or ``[]`` when it never submitted.

    >>> from birdenv.tools import format_tool_call
    >>> submitted([{"role": "assistant", "content": format_tool_call("submit_solution", sql_list=["SELECT 1"])}])
    ['SELECT 1']
    >>> submitted([{"role": "assistant", "content": "no call"}])
    []
    """
    for message in reversed(messages):
        if message["role"] != "assistant":
            continue
        try:
            call = parse_tool_call(message["content"])
        except ToolCallError:
            return []
        return call.arguments["sql_list"] if call.name == "submit_solution" else []
    return []


class Rollouts(list):
    """The episodes of one :func:`collect` call, plus where the call's wall time went.

    ``generation_s`` is time spent in ``policy.generate``, ``env_s`` in the vector env's ``reset``
    and ``step``; ``env_steps`` counts sub-environment steps that carried a model turn;
    ``timeline`` holds those calls, and the judge's runs inside the steps, as intervals.
    """

    def __init__(self, items: Sequence[Episode] = ()) -> None:
        super().__init__(items)
        self.generation_s = 0.0
        self.env_s = 0.0
        self.env_steps = 0
        self.timeline = Timeline()


# --------------------------------------------------------------------------------------------
# Chat-template accounting


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=TOOL_SCHEMAS, tokenize=False, add_generation_prompt=generation_prompt
    )


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the conversation's start (the user prompt), ready for the first assistant turn."""
    return _encode(tokenizer, _render(tokenizer, messages, generation_prompt=True))


def tool_suffix_ids(
    tokenizer: Any, messages: list[dict[str, str]], *, turn_ended_with_eos: bool
) -> list[int]:
    """Template tokens that follow an assistant turn: its closing, the tool message, the next opening.

    ``messages`` ends with ``[..., assistant, tool]``. The assistant content is replaced by a
    sentinel and the conversation rendered with a generation prompt; the text after the sentinel is
    the suffix. When the model's turn already ended with an EOS (the template's end-of-turn, or
    another id of the model's that ends a turn), the template's is not added after it.
    """
    probe = [dict(m) for m in messages]
    probe[-2] = {"role": "assistant", "content": _SENTINEL}
    text = _render(tokenizer, probe, generation_prompt=True)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not render assistant content verbatim")
    suffix = text[text.index(_SENTINEL) + len(_SENTINEL) :]
    eos = tokenizer.eos_token
    if turn_ended_with_eos:
        if not suffix.startswith(eos):
            raise ValueError(
                f"the chat template does not close an assistant turn with EOS {eos!r}; "
                "token accounting across turns would not match the template"
            )
        suffix = suffix[len(eos) :]
    return _encode(tokenizer, suffix)


# --------------------------------------------------------------------------------------------
# The loop


def _unbatch(infos: dict[str, Any], i: int) -> dict[str, Any]:
    """Copy ``i``'s info dict out of Gymnasium's batched ``infos`` (arrays with ``_key`` masks)."""
    out: dict[str, Any] = {}
    for key, value in infos.items():
        if key.startswith("_"):
            continue
        mask = infos.get(f"_{key}")
        if mask is not None and not mask[i]:
            continue
        if isinstance(value, dict):
            out[key] = _unbatch(value, i)
        else:
            item = value[i]
            out[key] = item.item() if isinstance(item, np.generic) else item
    return out


def _check_autoreset(envs: Any) -> None:
    mode = getattr(envs, "autoreset_mode", None) or envs.metadata.get("autoreset_mode")
    if mode is None or gym.vector.AutoresetMode(mode) != AUTORESET_MODE:
        raise ValueError(
            f"collect needs a vector env with autoreset_mode=AutoresetMode.DISABLED, not {mode}: "
            "build it with make_vec(..., vector_kwargs=birdtrain.rollout.VECTOR_KWARGS), or pass "
            "autoreset_mode=gymnasium.vector.AutoresetMode.DISABLED to SyncVectorEnv or "
            "AsyncVectorEnv"
        )


class Scheduler:
    """Which rollout each copy of a vector env (a *slot*) plays: every rollout of every task once,
    each to the first free slot, in task order.

    ``slots[i]`` is the rollout slot ``i`` plays (None: free) and ``contexts[i]`` its tokens so far.
    ``ended[i]`` says that copy ``i``'s episode ended (or never began): it must be reset before it
    is stepped again. ``on_episode`` is called with each rollout as it ends.
    """

    def __init__(
        self,
        num_slots: int,
        task_ids: Sequence[str],
        num_generations: int,
        on_episode: Callable[[Episode], None] | None = None,
    ) -> None:
        self.pending = deque(
            Episode(task_id=str(t), group=g) for t in task_ids for g in range(num_generations)
        )
        self.order = {(e.task_id, e.group): k for k, e in enumerate(self.pending)}
        self.slots: list[Episode | None] = [None] * num_slots
        self.contexts: list[list[int]] = [[] for _ in range(num_slots)]
        self.ended = [True] * num_slots
        self.last_task = [str(task_ids[0]) if len(task_ids) else ""] * num_slots
        self.done = Rollouts()
        self.on_episode = on_episode

    def busy(self) -> bool:
        """True while rollouts are pending or in flight."""
        return bool(self.pending) or bool(self.in_flight())

    def in_flight(self) -> list[int]:
        """The slots playing a rollout."""
        return [i for i, episode in enumerate(self.slots) if episode is not None]

    def assign(self) -> dict[int, str]:
        """Slot → the task to reset it on: free slots take the next pending rollouts; a free slot
        with nothing left to do whose copy ended restarts its last task, since every copy is
        stepped."""
        resets = {}
        for i, episode in enumerate(self.slots):
            if episode is None and self.pending:
                self.slots[i] = self.pending.popleft()
                resets[i] = self.last_task[i] = self.slots[i].task_id
            elif episode is None and self.ended[i]:
                resets[i] = self.last_task[i]
        return resets

    def finish(self, i: int, *, truncated: bool = False, error: str | None = None) -> None:
        """Slot ``i``'s rollout is over: ``truncated`` (out of turns or context, kept) or broken
        (``error``: dropped)."""
        episode = self.slots[i]
        episode.truncated = episode.truncated or truncated
        if error is not None:
            episode.dropped, episode.error = True, error
        self.done.append(episode)
        self.slots[i], self.contexts[i] = None, []
        if self.on_episode is not None:
            self.on_episode(episode)

    def break_all(self, exc: BaseException) -> None:
        """A vector call failed. It cannot be pinned on one copy: every rollout in flight broke,
        and every copy is reset before its next step."""
        for i in self.in_flight():
            self.finish(i, error=f"{type(exc).__name__}: {exc}")
        self.ended = [True] * len(self.slots)

    def timed(self, kind: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, its wall time charged to the call and to the rollouts in flight."""
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.perf_counter()
            self.done.timeline.add(kind, start, end)
            field = "generation_s" if kind == "generation" else "env_s"
            setattr(self.done, field, getattr(self.done, field) + end - start)
            for i in self.in_flight():
                setattr(self.slots[i], field, getattr(self.slots[i], field) + end - start)

    def result(self) -> Rollouts:
        """The finished rollouts, by task then group."""
        self.done.sort(key=lambda e: self.order[(e.task_id, e.group)])
        return self.done


def _reset(envs: Any, plan: Scheduler, resets: dict[int, str], tokenizer: Any) -> None:
    """Reset the slots on their tasks, one vector ``reset`` per task, and start their rollouts."""
    for task_id in dict.fromkeys(resets.values()):
        mask = np.array([resets.get(i) == task_id for i in range(envs.num_envs)])
        _, infos = plan.timed("env", envs.reset, options={"task_id": task_id, "reset_mask": mask})
        for i in np.flatnonzero(mask):
            plan.ended[i] = False
            episode = plan.slots[i]
            if episode is not None and not episode.messages:
                episode.messages = [dict(m) for m in _unbatch(infos, i)["messages"]]
                episode.prompt_ids = prompt_ids(tokenizer, episode.messages)
                plan.contexts[i] = list(episode.prompt_ids)


def _take_turn(
    episode: Episode,
    context: list[int],
    ids: list[int],
    logps: list[float],
    tokenizer: Any,
    eos_ids: frozenset[int],
) -> str:
    """Record a generated turn; return its text (without the EOS that ended it), the action the
    env is stepped with."""
    episode.segments.append(Segment(list(ids), True, [float(x) for x in logps]))
    context += ids
    episode.turns += 1
    body = ids[:-1] if ids and ids[-1] in eos_ids else ids
    action = tokenizer.decode(body, skip_special_tokens=False)
    if has_tool_call(action):
        episode.tool_calls += 1
    else:
        episode.invalid_calls += 1
    return action


def _take_step(
    plan: Scheduler,
    i: int,
    action: str,
    outcome: tuple[dict[str, Any], float, bool, bool],
    *,
    max_turns: int,
    max_context: int,
    tokenizer: Any,
    eos_ids: frozenset[int],
) -> None:
    """Record what the env answered slot ``i``'s turn; end the rollout or queue the tool block."""
    info, reward, terminated, truncated = outcome
    episode, context = plan.slots[i], plan.contexts[i]
    messages = info.get("messages") or []
    if info.get("task_id") != episode.task_id or messages[-2:-1] != [
        {"role": "assistant", "content": action}
    ]:  # an env that resets behind the loop's back (a wrapper, another autoreset) broke it
        # A copy whose Ray actor was lost says so (birdenv.ray_vector); others just miss the turn.
        plan.finish(
            i,
            error=info.get("broken")
            or f"the environment did not record the turn (task {info.get('task_id')!r})",
        )
        return
    episode.messages = [dict(m) for m in messages]
    episode.statement_s.append(info.get("elapsed"))  # None unless the turn ran a statement
    if terminated or truncated:
        episode.reward, episode.verdict = reward, info.get("verdict")
        plan.done.timeline.add_judge(episode.verdict, time.perf_counter())  # judged in this step
        plan.finish(i, truncated=truncated and not terminated)
        return
    if episode.turns >= max_turns:  # out of turns: the copy's episode is abandoned
        plan.finish(i, truncated=True)
        return
    ended_with_eos = bool(episode.segments[-1].ids) and episode.segments[-1].ids[-1] in eos_ids
    suffix = tool_suffix_ids(tokenizer, messages, turn_ended_with_eos=ended_with_eos)
    if len(context) + len(suffix) >= max_context:
        plan.finish(i, truncated=True)
        return
    episode.segments.append(Segment(suffix, False, [0.0] * len(suffix)))
    context += suffix


def collect(
    envs: Any,
    policy: Policy,
    task_ids: Sequence[str],
    *,
    num_generations: int,
    max_turns: int,
    max_new_tokens: int,
    temperature: float,
    max_context: int,
    on_episode: Callable[[Episode], None] | None = None,
) -> Rollouts:
    """Run ``num_generations`` rollouts of each task in ``task_ids`` and return them in task order.

    Args:
        envs: A ``gymnasium.vector.VectorEnv`` of the birdenv envs with ``autoreset_mode`` :data:`AUTORESET_MODE`.
        policy: A :class:`~birdtrain.policies.Policy` (e.g. :class:`~birdtrain.policies.TransformersPolicy`).
        task_ids: Tasks to roll out; rollout ``g`` of task ``t`` has ``task_id=t, group=g``.
        num_generations: Rollouts per task (the GRPO group size).
        max_turns: Assistant turns before a rollout is truncated (reward 0).
        max_new_tokens: Tokens per assistant turn.
        temperature: Sampling temperature (0: greedy).
        max_context: Tokens of context; a rollout that fills it is truncated (reward 0).
        on_episode: Called with each rollout as it ends (an evaluation saves it there).

    Returns:
        :class:`Rollouts`: ``len(task_ids) * num_generations`` episodes, ordered by task then
        group, with the call's time split. A rollout whose env call failed is ``dropped``.
    """
    _check_autoreset(envs)
    tokenizer = policy.tokenizer
    # An engine with a window of its own (a vLLM engine's max_model_len) ends a rollout there too.
    max_context = min(max_context, getattr(policy, "max_context", None) or max_context)
    eos_ids = getattr(policy, "eos_ids", None) or frozenset({tokenizer.eos_token_id})
    plan = Scheduler(envs.num_envs, task_ids, num_generations, on_episode)
    # The weights do not change during the call: the policy may keep each rollout's keys and values
    # from one turn to the next (TransformersPolicy.turns).
    turns = getattr(policy, "turns", None)
    with turns() if turns is not None else contextlib.nullcontext():
        while plan.busy():
            # 1. Free slots start their next rollouts; an idle copy whose episode ended is reset too.
            try:
                _reset(envs, plan, plan.assign(), tokenizer)
            except Exception as exc:
                plan.break_all(exc)
                continue
            # 2. One turn for every rollout in flight, in one batch; a full context truncates.
            budgets = {
                i: min(max_new_tokens, max_context - len(plan.contexts[i]))
                for i in plan.in_flight()
            }
            for i in [i for i, budget in budgets.items() if budget <= 0]:
                plan.finish(i, truncated=True)
                del budgets[i]
            if not budgets:
                continue
            contexts = [plan.contexts[i] for i in budgets]
            outputs = plan.timed(
                "generation",
                policy.generate,
                contexts,
                max_new_tokens=max(budgets.values()),
                temperature=temperature,
            )
            actions = [""] * envs.num_envs  # idle copies get an empty turn
            for (i, budget), (ids, logps) in zip(budgets.items(), outputs, strict=True):
                actions[i] = _take_turn(
                    plan.slots[i],
                    plan.contexts[i],
                    ids[:budget],
                    logps[:budget],
                    tokenizer,
                    eos_ids,
                )
            # 3. Step every copy.
            try:
                _, rewards, terminated, truncated, infos = plan.timed(
                    "env", envs.step, tuple(actions)
                )
            except Exception as exc:
                plan.break_all(exc)
                continue
            plan.done.env_steps += len(budgets)
            plan.ended = [bool(t or u) for t, u in zip(terminated, truncated, strict=True)]
            for i in budgets:
                outcome = (
                    _unbatch(infos, i),
                    float(rewards[i]),
                    bool(terminated[i]),
                    bool(truncated[i]),
                )
                _take_step(
                    plan,
                    i,
                    actions[i],
                    outcome,
                    max_turns=max_turns,
                    max_context=max_context,
                    tokenizer=tokenizer,
                    eos_ids=eos_ids,
                )
    return plan.result()

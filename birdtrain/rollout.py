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

Scheduling: every copy of the vector env is a *slot*. A slot is reset explicitly on its rollout's
task (``reset(options={"task_id": ..., "reset_mask": one_slot})``) and stepped with the model's
turn; slots without work receive an empty turn. Autoreset is never used to start an episode, and
two of its traps are handled:

- after ``terminated``/``truncated``, Gymnasium's default ``AutoresetMode.NEXT_STEP`` resets the
  copy on its next step and ignores that action. A slot that finished is therefore stepped once
  with an empty turn (draining the pending autoreset) before it is reset for its next rollout.
- ``AsyncVectorEnv(shared_memory=False)`` (the only mode text spaces work in) does not clear a
  worker's pending autoreset on an explicit ``reset`` in Gymnasium 1.4. Every step is therefore
  checked: the copy's ``info["messages"]`` must end with the turn just sent, on the right task. A
  rollout whose first turn was swallowed by a stale autoreset is reset again and the turn resent.

With ``AutoresetMode.DISABLED`` a finished copy cannot be stepped at all, so idle finished slots
are reset before the next step.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from birdenv.tools import TOOL_SCHEMAS, ToolCallError, parse_tool_call
from birdtrain.policies import Policy

__all__ = [
    "Episode",
    "Rollouts",
    "Segment",
    "collect",
    "prompt_ids",
    "submitted",
    "tool_suffix_ids",
]

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
    """The episodes of one :func:`collect` call, plus the call's wall-clock split.

    ``generation_s`` is time spent in ``policy.generate``, ``env_s`` in the vector env's ``reset``
    and ``step``; ``env_steps`` counts sub-environment steps that carried a model turn.
    """

    def __init__(self, items: Sequence[Episode] = ()) -> None:
        super().__init__(items)
        self.generation_s = 0.0
        self.env_s = 0.0
        self.env_steps = 0


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
    the suffix. When the model already emitted EOS (the template's end-of-turn), that token is not
    repeated.
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
# Vector-env plumbing


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


def _autoreset_mode(envs: Any) -> str:
    mode = getattr(envs, "autoreset_mode", None) or envs.metadata.get("autoreset_mode")
    return str(getattr(mode, "value", mode) or "NextStep")


def _onehot(n: int, indices: list[int]) -> np.ndarray:
    mask = np.zeros(n, dtype=np.bool_)
    mask[indices] = True
    return mask


@dataclasses.dataclass
class _Slot:
    traj: Episode | None = None
    context: list[int] = dataclasses.field(default_factory=list)
    action: str | None = None  # the turn sent in the current step
    retried: bool = False
    needs_drain: bool = False  # finished in NEXT_STEP mode: its next step is an autoreset
    finished: bool = True  # the copy's episode has ended (DISABLED mode must reset it)
    last_task: str | None = None


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
) -> Rollouts:
    """Run ``num_generations`` rollouts of each task in ``task_ids`` and return them in task order.

    Args:
        envs: Any ``gymnasium.vector.VectorEnv`` of ``BirdCriticEnv`` (any autoreset mode).
        policy: A :class:`Policy` (e.g. :class:`~birdtrain.policies.TransformersPolicy`).
        task_ids: Tasks to roll out; trajectory ``g`` of task ``t`` has ``task_id=t, group=g``.
        num_generations: Rollouts per task (the GRPO group size).
        max_turns: Assistant turns before a rollout is truncated (reward 0).
        max_new_tokens: Tokens per assistant turn.
        temperature: Sampling temperature (0: greedy).
        max_context: Tokens of context; a rollout that fills it is truncated (reward 0).

    Returns:
        :class:`Rollouts`: ``len(task_ids) * num_generations`` trajectories, ordered by task then
        group, with the call's generation/env time split.
    """
    tokenizer = policy.tokenizer
    n = envs.num_envs
    mode = _autoreset_mode(envs)
    pending = deque(
        Episode(task_id=str(t), group=g) for t in task_ids for g in range(num_generations)
    )
    done = Rollouts()
    order = {(t.task_id, t.group): k for k, t in enumerate(pending)}
    slots = [_Slot() for _ in range(n)]
    fresh = True  # the copies' state is unknown before the first reset

    def timed_env(fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            done.env_s += elapsed
            for slot in slots:
                if slot.traj is not None:
                    slot.traj.env_s += elapsed

    def finish(slot: _Slot) -> None:
        assert slot.traj is not None
        done.append(slot.traj)
        slot.traj, slot.context, slot.action, slot.retried = None, [], None, False

    def break_all(exc: BaseException) -> None:
        # A failed vector call cannot be attributed to one copy: every rollout in flight broke.
        for slot in slots:
            if slot.traj is not None:
                slot.traj.dropped, slot.traj.error = True, f"{type(exc).__name__}: {exc}"
                finish(slot)
            slot.finished, slot.needs_drain = True, False

    def reset_slots(assign: dict[int, str]) -> dict[int, tuple[str, dict[str, Any]]]:
        """Reset the given slots on their tasks, one vector ``reset`` per distinct task."""
        by_task: dict[str, list[int]] = {}
        for i, task_id in assign.items():
            by_task.setdefault(task_id, []).append(i)
        results = {}
        for task_id, indices in by_task.items():
            obs, infos = timed_env(
                envs.reset, options={"task_id": task_id, "reset_mask": _onehot(n, indices)}
            )
            for i in indices:
                results[i] = (obs[i], _unbatch(infos, i))
                slots[i].finished, slots[i].needs_drain = False, False
                slots[i].last_task = task_id
        return results

    def start(slot_index: int, traj: Episode, info: dict[str, Any]) -> None:
        slot = slots[slot_index]
        if info.get("task_id") != traj.task_id:
            raise RuntimeError(
                f"slot {slot_index} was reset on {traj.task_id!r} but reports {info.get('task_id')!r}"
            )
        traj.messages = [dict(m) for m in info["messages"]]
        traj.prompt_ids = prompt_ids(tokenizer, traj.messages)
        slot.traj, slot.context = traj, list(traj.prompt_ids)

    while pending or any(s.traj is not None for s in slots):
        # 1. Give free slots new rollouts (explicit reset on the task; never autoreset).
        assign: dict[int, str] = {}
        for i, slot in enumerate(slots):
            if slot.traj is None and not slot.needs_drain and pending:
                traj = pending.popleft()
                assign[i] = traj.task_id
                slot.traj = traj
            elif fresh or (slot.traj is None and slot.finished and mode == "Disabled"):
                # Every copy is stepped; one that was never reset (or cannot step) gets a task.
                assign[i] = slot.last_task or str(task_ids[0])
        fresh = False
        if assign:
            try:
                results = reset_slots(assign)
            except Exception as exc:
                break_all(exc)
                continue
            for i, (_, info) in results.items():
                if slots[i].traj is not None and not slots[i].traj.segments:
                    try:
                        start(i, slots[i].traj, info)
                    except Exception as exc:
                        slots[i].traj.dropped, slots[i].traj.error = True, str(exc)
                        finish(slots[i])
        # 2. Generate a turn for every slot that needs one, in one batch.
        active = [i for i, s in enumerate(slots) if s.traj is not None and s.action is None]
        if active:
            budgets = {i: min(max_new_tokens, max_context - len(slots[i].context)) for i in active}
            for i in [i for i in active if budgets[i] <= 0]:
                slots[i].traj.truncated = True
                finish(slots[i])
            active = [i for i in active if budgets[i] > 0]
        if active:
            start_t = time.perf_counter()
            outputs = policy.generate(
                [slots[i].context for i in active],
                max_new_tokens=max(budgets[i] for i in active),
                temperature=temperature,
            )
            elapsed = time.perf_counter() - start_t
            done.generation_s += elapsed
            for i, (ids, lps) in zip(active, outputs, strict=True):
                slot = slots[i]
                ids, lps = list(ids[: budgets[i]]), [float(x) for x in lps[: budgets[i]]]
                slot.traj.generation_s += elapsed
                slot.traj.segments.append(Segment(ids, True, lps))
                slot.context += ids
                slot.traj.turns += 1
                body = ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids
                slot.action = tokenizer.decode(body, skip_special_tokens=False)
                try:
                    parse_tool_call(slot.action)
                    slot.traj.tool_calls += 1
                except ToolCallError:
                    slot.traj.invalid_calls += 1
        if not any(s.traj is not None for s in slots) and not (
            pending and any(s.needs_drain for s in slots)
        ):
            continue
        # 3. Step every copy: the model's turns, an empty turn for the rest.
        actions = [s.action if s.traj is not None and s.action is not None else "" for s in slots]
        try:
            _obs, rewards, terminated, truncated, infos = timed_env(envs.step, tuple(actions))
        except Exception as exc:
            break_all(exc)
            continue
        done.env_steps += sum(1 for s in slots if s.traj is not None)
        for i, slot in enumerate(slots):
            ended = bool(terminated[i] or truncated[i])
            if slot.traj is None:
                # An idle copy: an autoreset step clears a pending reset; a new episode may end.
                slot.needs_drain = ended and mode == "NextStep"
                slot.finished = ended or (slot.finished and mode != "NextStep")
                continue
            info = _unbatch(infos, i)
            if ended and mode == "SameStep":
                info = _unbatch(infos["final_info"], i) if "final_info" in infos else info
            traj, action = slot.traj, slot.action
            messages = info.get("messages") or []
            if (
                info.get("task_id") != traj.task_id
                or len(messages) < 2
                or messages[-2] != {"role": "assistant", "content": action}
            ):
                # A stale autoreset swallowed the turn (see the module docstring): reset and resend.
                if not slot.retried and traj.turns == 1 and not ended:
                    slot.retried = True
                    try:
                        _, again = reset_slots({i: traj.task_id})[i]
                    except Exception as exc:
                        break_all(exc)
                        break
                    if again.get("messages") == traj.messages:
                        continue  # same prompt; the same turn goes out in the next step
                traj.dropped = True
                traj.error = (
                    f"the environment did not record the turn (task {info.get('task_id')!r})"
                )
                slot.needs_drain, slot.finished = ended and mode == "NextStep", True
                finish(slot)
                continue
            traj.messages = [dict(m) for m in messages]
            traj.statement_s.append(info.get("elapsed"))  # None unless the turn ran a statement
            slot.action = None
            if ended:
                traj.reward = float(rewards[i])
                traj.verdict = info.get("verdict")
                traj.truncated = bool(truncated[i]) and not bool(terminated[i])
                slot.needs_drain, slot.finished = mode == "NextStep", True
                finish(slot)
            elif traj.turns >= max_turns:
                # Out of turns without a submission: the copy's episode is abandoned, and the copy
                # is reset explicitly before its next rollout.
                traj.truncated, slot.finished = True, True
                finish(slot)
            else:
                ended_with_eos = bool(
                    traj.segments[-1].ids and traj.segments[-1].ids[-1] == tokenizer.eos_token_id
                )
                suffix = tool_suffix_ids(tokenizer, messages, turn_ended_with_eos=ended_with_eos)
                if len(slot.context) + len(suffix) >= max_context:
                    traj.truncated, slot.finished = True, True
                    finish(slot)
                    continue
                traj.segments.append(Segment(suffix, False, [0.0] * len(suffix)))
                slot.context += suffix
    done.sort(key=lambda t: order[(t.task_id, t.group)])
    return done

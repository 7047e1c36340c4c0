"""The episode players: reference agents and endpoints in plain environments on threads, local
models in a vector environment through :func:`birdtrain.rollout.collect`, and single answers."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from birdenv.envs import task_env
from birdenv.replicas.pool import default_pool
from birdenv.tasks import Task
from birdenv.vector import make_vec
from birdtrain.config import EvaluationConfig
from birdtrain.data.kinds import training_kind
from birdtrain.policies import EndpointPolicy, VLLMEnginePolicy, generation_policy
from birdtrain.prompts import parse_solution, single_turn_prompt
from birdtrain.rollout import VECTOR_KWARGS, Episode, collect
from birdtrain.timeline import Timeline

__all__ = ["REFERENCE_POLICIES", "Act", "engines_built", "play_episodes", "sharing_engines"]

#: The reference policies: agents that need no model.
REFERENCE_POLICIES = ("oracle", "echo", "scripted")
#: An agent: the next turn from the last observation and info (``info["messages"]``).
Act = Callable[[str, dict[str, Any]], str]


# -- agents that act in a plain env, one per worker thread --------------------------------------
def _reference_agent(policy: str, max_turns: int) -> Callable[[Task], Act]:
    """``oracle`` and ``echo`` play each kind's reference turns and ``scripted`` its offline
    expert, which explores with real evidence before it submits the known fix (or the gold
    query): both the task's :class:`~birdtrain.data.kinds.TrainingKind`'s."""

    def agent(task: Task) -> Act:
        training = training_kind(task.kind)
        if policy == "scripted":
            return training.expert(task, default_pool(), max_turns).act
        planned = iter(training.reference_turns(policy, task))
        return lambda observation, info: next(planned)

    return agent


def _play(
    env: Any,
    task: Task,
    sample: int,
    agent: Callable[[Task], Act],
    max_turns: int,
    timeline: Timeline,
) -> Episode:
    """One episode of ``task`` in ``env``; the agent's time is generation, the env's environment."""
    episode = Episode(task_id=task.instance_id, group=sample)

    def timed(kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        end = time.perf_counter()
        timeline.add(kind, start, end)
        if kind == "generation":
            episode.generation_s += end - start
        else:
            episode.env_s += end - start
        return result

    act = timed("generation", agent, task)
    observation, info = timed("env", env.reset, options={"task_id": task.instance_id})
    for _ in range(max_turns):
        turn = timed("generation", act, observation, info)
        observation, episode.reward, terminated, truncated, info = timed("env", env.step, turn)
        episode.statement_s.append(info.get("elapsed"))
        episode.turns += 1
        if terminated or truncated:
            break
    stepped = time.perf_counter()
    episode.messages, episode.verdict = info["messages"], info.get("verdict")
    timeline.add_judge(episode.verdict, stepped)  # the judge ran at the end of the last step
    return episode


def _endpoint_agent(
    policy: str, *, max_new_tokens: int, temperature: float
) -> Callable[[Task], Act]:
    """An OpenAI-compatible model as an agent: it reads the env's conversation each turn."""
    endpoint = EndpointPolicy.from_spec(policy)

    def act(observation: str, info: dict[str, Any]) -> str:
        return endpoint.turn(
            info["messages"], max_new_tokens=max_new_tokens, temperature=temperature
        )

    return lambda task: act


def _threaded(
    tasks: list[Task],
    agent: Callable[[Task], Act],
    timeline: Timeline,
    *,
    n: int,
    num_envs: int,
    max_turns: int,
    prompt: Any,
    on_episode: Callable[[Episode], None],
) -> list[Episode]:
    """``n`` episodes of every task, one plain env per worker thread (sharing one replica pool or PostgreSQL server),
    with the prompt setting ``prompt``; ``on_episode`` sees each as it ends."""

    jobs = [(t, s) for t in tasks for s in range(n)]

    def worker(chunk: list[tuple[Task, int]]) -> list[Episode]:
        env = task_env(tasks, prompt_options=prompt)  # each task in its kind's and dialect's env
        episodes = []
        try:
            for task, sample in chunk:
                episodes.append(_play(env, task, sample, agent, max_turns, timeline))
                on_episode(episodes[-1])
        finally:
            env.close()
        return episodes

    chunks = [jobs[i::num_envs] for i in range(min(num_envs, len(jobs)))]
    with concurrent.futures.ThreadPoolExecutor(len(chunks)) as pool:
        return [e for part in pool.map(worker, chunks) for e in part]


#: The generation policies open in a :func:`sharing_engines` block, by what built them; None
#: outside one (each evaluation starts and stops its own).
_SHARED: dict[str, Any] | None = None
#: How many generation policies (engines) this process has built.
_BUILT = 0


def engines_built() -> int:
    """How many generation policies this process has built: an evaluation that reused the
    engine of an earlier one in a :func:`sharing_engines` block built none."""
    return _BUILT


@contextlib.contextmanager
def sharing_engines() -> Iterator[None]:
    """Within this block, evaluations that generate from the same checkpoint with the same engine
    settings share one generation policy: a vLLM engine starts once (~80 s on a CPU) for all of
    them, and every one started is stopped when the block ends. A curriculum's evaluation round
    (one policy, several task sets and modes) runs in one such block."""
    global _SHARED
    if _SHARED is not None:  # nested: the outer block owns the engines
        yield
        return
    _SHARED = {}
    try:
        yield
    finally:
        shared, _SHARED = _SHARED, None
        for generator in shared.values():
            if hasattr(generator, "close"):
                generator.close()


# -- local models --------------------------------------------------------------------------------
def _model_episodes(
    model_path: str,
    tasks: list[Task],
    *,
    n: int,
    max_turns: int,
    max_new_tokens: int,
    temperature: float,
    num_envs: int,
    engine: str,
    prompt: Any,
    timeline: Timeline,
    ray: bool,
    max_context: int,
    engine_options: dict[str, Any] | None,
    dtype: str,
    on_episode: Callable[[Episode], None],
) -> list[Episode]:
    """A local model as an agent, rolled out through a vector env exactly as in stage 4 (with
    ``ray``: a Ray vector env over the cluster); ``on_episode`` sees each episode as it ends."""

    # The env workers fork before the engine starts: a vLLM engine's threads, sockets and locks
    # do not survive a fork. In a sharing_engines block the vLLM engine of an earlier evaluation
    # may run already, so the workers then start from the fork server (a process that never
    # loaded it). Only then: the fork server is one more process a signal to the group ends.
    engine_running = any(isinstance(g, VLLMEnginePolicy) for g in (_SHARED or {}).values())
    vector_kwargs = {**VECTOR_KWARGS, "context": "forkserver"} if engine_running else VECTOR_KWARGS
    envs = make_vec(
        min(num_envs, len(tasks) * n),
        tasks=tasks,
        backend="ray" if ray else ("async" if num_envs > 1 else "sync"),
        max_episode_steps=max_turns,
        prompt_options=prompt,
        vector_kwargs=vector_kwargs,
    )
    try:
        with _generation_policy(
            model_path,
            engine=engine,
            engine_options=engine_options,
            dtype=dtype,
            contexts=num_envs,
        ) as generator:
            rollouts = collect(
                envs,
                generator,
                [t.instance_id for t in tasks],
                num_generations=n,
                max_turns=max_turns,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                max_context=max_context,
                on_episode=on_episode,
            )
    finally:
        envs.close()
    timeline.extend(rollouts.timeline)
    return list(rollouts)


@contextlib.contextmanager
def _generation_policy(model_path: str, **options: Any) -> Iterator[Any]:
    """:func:`~birdtrain.policies.generation_policy`, its engine stopped when the body ends (a
    vLLM engine runs in a process of its own), or kept for the next evaluation inside a
    :func:`sharing_engines` block."""

    key = json.dumps([model_path, options], sort_keys=True, default=str)
    if _SHARED is not None and key in _SHARED:
        yield _SHARED[key]
        return
    global _BUILT
    generator = generation_policy(model_path, **options)
    _BUILT += 1
    if _SHARED is not None:
        _SHARED[key] = generator
        yield generator
        return
    try:
        yield generator
    finally:
        if hasattr(generator, "close"):
            generator.close()


def _single_episodes(
    policy: str,
    tasks: list[Task],
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    engine: str,
    prompt: Any,
    timeline: Timeline,
    engine_options: dict[str, Any] | None,
    dtype: str,
    num_envs: int,
    on_episode: Callable[[Episode], None],
) -> list[Episode]:
    """One ``<solution>`` per sample from a model or an endpoint (not judged yet), a model's
    generated ``num_envs`` prompts at a time; ``on_episode`` sees each answer as it comes."""

    jobs = [(t, s) for t in tasks for s in range(n)]
    prompts = [[{"role": "user", "content": single_turn_prompt(t, prompt)}] for t, _ in jobs]
    episodes: list[Episode] = []

    def answered(text: str) -> None:
        (task, sample), messages = jobs[len(episodes)], prompts[len(episodes)]
        episodes.append(
            Episode(
                task_id=task.instance_id,
                group=sample,
                messages=[*messages, {"role": "assistant", "content": text}],
                pred_sqls=parse_solution(text),
                turns=1,
            )
        )
        on_episode(episodes[-1])

    if policy.startswith(EndpointPolicy.PREFIX):
        endpoint = EndpointPolicy.from_spec(policy)
        with timeline.span("generation"):
            for p in prompts:
                answered(endpoint.answer(p, max_new_tokens=max_new_tokens, temperature=temperature))
        return episodes
    with _generation_policy(
        policy, engine=engine, engine_options=engine_options, dtype=dtype, contexts=num_envs
    ) as generator:
        tokenizer = generator.tokenizer
        with timeline.span("generation"):
            for i in range(0, len(prompts), num_envs):
                batch = [
                    tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
                    for p in prompts[i : i + num_envs]
                ]
                # transformers 5 returns a BatchEncoding (a mapping, not a dict) for tokenize=True.
                batch = [list(ids["input_ids"] if hasattr(ids, "keys") else ids) for ids in batch]
                for ids, _ in generator.generate(
                    batch, max_new_tokens=max_new_tokens, temperature=temperature
                ):
                    answered(tokenizer.decode(ids, skip_special_tokens=True))
    return episodes


def play_episodes(
    policy: str,
    tasks: list[Task],
    config: EvaluationConfig,
    *,
    timeline: Timeline,
    on_episode: Callable[[Episode], None],
) -> list[Episode]:
    """The policy's episodes under ``config`` (its ``prompt`` resolved to the setting to play
    with): answers (single mode), or agents in envs (reference policies and endpoints in plain
    envs on threads, local models in a vector env through ``collect``); ``on_episode`` sees each
    as it ends."""
    c = config
    sampling = {"max_new_tokens": c.max_new_tokens, "temperature": c.temperature}
    if c.mode == "single":
        return _single_episodes(
            policy,
            tasks,
            n=c.n,
            engine=c.engine,
            prompt=c.prompt,
            engine_options=c.engine_options,
            dtype=c.dtype,
            num_envs=c.num_envs,
            timeline=timeline,
            on_episode=on_episode,
            **sampling,
        )
    threads = {
        "n": c.n,
        "num_envs": c.num_envs,
        "max_turns": c.max_turns,
        "prompt": c.prompt,
        "on_episode": on_episode,
    }
    if policy in REFERENCE_POLICIES:
        agent = _reference_agent(policy, c.max_turns)
        return _threaded(tasks, agent, timeline, **threads)
    if policy.startswith(EndpointPolicy.PREFIX):
        return _threaded(tasks, _endpoint_agent(policy, **sampling), timeline, **threads)
    return _model_episodes(
        policy,
        tasks,
        n=c.n,
        max_turns=c.max_turns,
        num_envs=c.num_envs,
        engine=c.engine,
        prompt=c.prompt,
        timeline=timeline,
        ray=c.ray,
        max_context=c.max_context,
        engine_options=c.engine_options,
        dtype=c.dtype,
        on_episode=on_episode,
        **sampling,
    )

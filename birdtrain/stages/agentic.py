"""Stage 4, interactive agentic RL: multi-turn GRPO against a ``gymnasium.vector.VectorEnv``.

Every optimizer step takes ``tasks_per_step`` tasks; each is rolled out ``num_generations`` times
(the GRPO group) in a vector environment of ``BirdCriticEnv`` (async by default, sync, Ray actors
over a cluster, or any the caller passes), each rollout on its own persistent database session, for up to ``max_turns``
assistant turns. The reward is the judge's verdict on the submission (``binary``: passed;
``fraction``: tests passed / total); running out of turns or context scores 0. A task mixture
(``data.mixture``) holding BIRD questions too gets one vector env of both environments
(:class:`birdenv.vector.MixedTaskEnv` copies): each rollout runs in its task's environment and
BIRD questions are rewarded by execution accuracy, so one group baseline never mixes kinds (a
group is one task). Tool-response and
template tokens are masked out of the loss; rollouts that *break* (an environment or worker error)
get an all-zero mask and a ``None`` reward, so TRL gives them zero advantage, keeps them out of the
group baseline and counts none of their tokens.

Why TRL's ``rollout_func`` and not ``environment_factory`` or a ``GRPOTrainer`` subclass:
``environment_factory`` creates its own environment objects one per rollout, so it cannot drive a
``VectorEnv`` the caller built (Async workers, a user's wrappers), and its tool loop re-parses
turns with the chat template's tool-call parser instead of the environment's. ``rollout_func`` is
the documented hook that hands generation to us and takes back exactly what the loss needs:
``prompt_ids``, ``completion_ids``, sampling ``logprobs`` and ``env_mask`` (TRL's tool mask:
0 = not trained on), plus extra fields that reach the reward function. Everything else (the GRPO
loss, KL to the reference, group-normalized advantages with ``None`` rewards, logging, vLLM weight
sync) stays TRL's, so a subclass for the rollouts would only add surface to keep in step with
TRL. The one subclass (``stage4.share_prompt``, :mod:`birdtrain.stages.shared_prompt`) changes
how a group's log-probabilities are computed, not what: its rollouts share their first prompt.

Read top to bottom: tasks and envs → dataset (one row per task) → ``rollout_func`` (collect) →
reward function (verdicts + per-step metrics) → ``GRPOConfig`` → train → metrics.jsonl → save.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from birdenv.tasks import Task, load_tasks
from birdenv.vector import make_vec
from birdtrain import rollout
from birdtrain.config import AgenticConfig, CurriculumConfig
from birdtrain.sampling import Group
from birdtrain.stages.arguments import grpo_arguments
from birdtrain.stages.grpo_step import Generate, StepColumns, rollout_function
from birdtrain.stages.loading import load_for_training
from birdtrain.stages.outputs import finish_stage
from birdtrain.stages.precision import Precision
from birdtrain.stages.shared_prompt import grpo_trainer_class
from birdtrain.stages.training import (
    check_batches,
    colocated_kv_cache,
    silence_trl_experimental,
    train,
)
from birdtrain.trajectory_store import TrajectoryStore, episode_rows

__all__ = [
    "build_dataset",
    "build_trainer",
    "make_reward_func",
    "make_rollout_func",
    "run",
    "trainer_arguments",
]

#: Per-step metrics the stage adds to TRL's (names in metrics.jsonl).
METRICS = (
    "agentic/reward_mean",
    "agentic/reward_std",
    "agentic/pass_rate",
    "agentic/tool_calls_per_traj",
    "agentic/invalid_call_rate",
    "agentic/turns",
    "agentic/env_steps",
    "agentic/env_s",
    "agentic/generation_s",
    "agentic/dropped",
    "agentic/truncated",
)


def build_dataset(tasks: Sequence[Task]) -> Any:
    """One row per task. The user message carries only the task id.

    ``rollout_func`` receives the prompts and nothing else of a row, so the prompt names the task;
    the real prompt (schema, issue, SQL, tool instructions) is rendered by the environment's
    ``reset``, exactly as at evaluation time.
    """
    # the train extra: imported only where used
    from datasets import Dataset

    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": t.instance_id}], "task_id": t.instance_id}
            for t in tasks
        ]
    )


def _reward_of(traj: rollout.Episode, format_weight: float = 0.0) -> float | None:
    """The GRPO reward of a trajectory: None when it broke, else the environment's own reward,
    plus ``format_weight`` times the share of its turns whose tool call parsed.

    The environment's reward is the verdict under its ``reward`` setting (``binary`` or
    ``fraction``, execution accuracy for BIRD questions); a rollout that never submitted got 0.
    The format term gives a policy that rarely passes a gradient toward calls the environment
    can run (``stage4.format_reward_weight``; 0 by default).
    """
    if traj.dropped:
        return None
    if not format_weight or not traj.turns:
        return traj.reward
    return traj.reward + format_weight * (traj.turns - traj.invalid_calls) / traj.turns


def make_rollout_func(
    envs: Any,
    stage: AgenticConfig,
    policy: Any = None,
    store: Any = None,
    categories: dict | None = None,
    *,
    pool: Sequence[str] | None = None,
    seed: int = 0,
    groups_path: Path | None = None,
) -> Any:
    """TRL's ``rollout_func(prompts, trainer)`` collecting multi-turn rollouts in ``envs``.

    TRL 1.16 passes the generation batch's prompts already repeated ``num_generations`` times
    (consecutively); each distinct task is rolled out ``num_generations`` times. With
    ``stage.dynamic_sampling_rounds`` a group whose rewards are all equal is replaced by the group
    of a task drawn from ``pool`` (default: the batch's tasks only, i.e. no replacements), up to
    that many rounds (:func:`birdtrain.sampling.dynamic_sample`); the batch handed back holds one
    group per slot, in the prompts' slots. ``policy(trainer) -> Policy`` replaces the trainer's own
    model as the actor (scripted baselines, tests); by default the trainer's model generates (vLLM
    when ``stage.use_vllm``). With a ``store`` (a
    :class:`~birdtrain.trajectory_store.TrajectoryStore`) every rollout is appended to it, one row per
    turn, replaced groups included; a run resumed from a checkpoint redoes the steps after it, and
    their rollouts replace those the interrupted run stored (as in ``groups.jsonl``). With
    ``groups_path`` each step's own draw is appended there
    (:func:`birdtrain.sampling.record_groups`).
    """
    stored: Counter[int] = Counter()  # rollout batches this process stored, by step

    def begin(trainer: Any, actor: Any, group: int) -> tuple[Generate, StepColumns]:
        spent = rollout.Rollouts()

        def generate(ids: list[str]) -> list[Group]:
            trajectories = rollout.collect(
                envs,
                actor,
                ids,
                num_generations=group,
                max_turns=stage.max_turns,
                max_new_tokens=stage.max_new_tokens,
                temperature=stage.temperature,
                max_context=stage.max_context,
            )
            spent.extend(trajectories)
            spent.env_s += trajectories.env_s
            spent.generation_s += trajectories.generation_s
            spent.env_steps += trajectories.env_steps
            if store is not None:
                step = trainer.state.global_step
                if not stored:  # the first step of this process: any stored from it on are undone
                    _forget_steps_from(store, step)
                _store(store, trajectories, step, stored[step], categories or {})
                stored[step] += 1
            return [
                Group(t, [_reward_of(tr, stage.format_reward_weight) for tr in items], items)
                for t in ids
                for items in [[tr for tr in trajectories if tr.task_id == t]]
            ]

        def columns(batch: list[Group]) -> dict[str, list[Any]]:
            eos = trainer.processing_class.eos_token_id
            out: dict[str, list[Any]] = {
                "prompt_ids": [],
                "completion_ids": [],
                "logprobs": [],
                "env_mask": [],
                "agent_reward": [],
                "agent_passed": [],
                "agent_dropped": [],
                "agent_truncated": [],
                "agent_tool_calls": [],
                "agent_invalid_calls": [],
                "agent_turns": [],
            }
            for g in batch:
                for traj, reward in zip(g.items, g.rewards, strict=True):
                    ids, mask, logps = traj.completion_ids, traj.mask, traj.logprobs
                    if traj.dropped:
                        # Broken: nothing of it may be trained on. TRL needs a non-empty sequence.
                        mask = [0] * len(ids)
                    if not ids:
                        ids, mask, logps = [eos], [0], [0.0]
                    out["prompt_ids"].append(traj.prompt_ids or [eos])
                    out["completion_ids"].append(ids)
                    out["logprobs"].append(logps)
                    out["env_mask"].append(mask)
                    out["agent_reward"].append(reward)
                    out["agent_passed"].append(traj.passed)
                    out["agent_dropped"].append(traj.dropped)
                    out["agent_truncated"].append(traj.truncated)
                    out["agent_tool_calls"].append(traj.tool_calls)
                    out["agent_invalid_calls"].append(traj.invalid_calls)
                    out["agent_turns"].append(traj.turns)
            # Step-level figures ride along once per row: TRL hands reward functions one value
            # per row.
            rows = len(out["prompt_ids"])
            out["agent_env_s"] = [spent.env_s] * rows
            out["agent_generation_s"] = [spent.generation_s] * rows
            out["agent_env_steps"] = [spent.env_steps] * rows
            return out

        return generate, columns

    return rollout_function(
        stage, begin, policy=policy, pool=pool, seed=seed, groups_path=groups_path
    )


#: The store's parts of stage 4 are named ``stage4-step{step}-{batch}``: a step's rollout
#: batches (dynamic sampling's rounds) in the order they were drawn.
STEP_PART = "stage4-step"


def _store(
    store: Any, trajectories: Sequence[Any], step: int, batch: int, categories: dict
) -> None:
    store.append(
        (
            row
            for traj in trajectories
            for row in episode_rows(
                traj, category=categories.get(traj.task_id, ""), stage="stage4", step=step
            )
        ),
        name=f"{STEP_PART}{step:06d}-{batch:03d}",
    )


def _forget_steps_from(store: Any, step: int) -> None:
    """Remove the parts of ``step`` and later: rollouts of steps an interrupted run took after its
    last checkpoint, which the resumed run takes again."""
    for part in store.parts(STEP_PART):
        if int(part.stem.removeprefix(f"part-{STEP_PART}").split("-")[0]) >= step:
            part.unlink()


def make_reward_func() -> Any:
    """The reward function: the environment's verdict (read from ``agent_reward``), plus metrics.

    It also logs the step's rollout statistics through TRL's ``log_metric`` hook, so they land in
    the same log entry as TRL's loss and KL.
    """

    def env_reward(
        prompts: list[Any],
        completions: list[Any],
        agent_reward: list[float | None],
        log_metric: Any = None,
        **kwargs: Any,
    ) -> list[float | None]:
        if log_metric is not None:
            kept = [i for i, d in enumerate(kwargs["agent_dropped"]) if not d]
            scored = [agent_reward[i] for i in kept]
            mean = sum(scored) / len(scored) if scored else 0.0
            std = math.sqrt(sum((r - mean) ** 2 for r in scored) / len(scored)) if scored else 0.0
            calls = sum(kwargs["agent_tool_calls"][i] for i in kept)
            invalid = sum(kwargs["agent_invalid_calls"][i] for i in kept)
            turns = sum(kwargs["agent_turns"][i] for i in kept)
            n = max(len(kept), 1)
            log_metric("agentic/reward_mean", mean)
            log_metric("agentic/reward_std", std)
            log_metric("agentic/pass_rate", sum(kwargs["agent_passed"][i] for i in kept) / n)
            log_metric("agentic/tool_calls_per_traj", calls / n)
            log_metric("agentic/invalid_call_rate", invalid / turns if turns else 0.0)
            log_metric("agentic/turns", turns / n)
            log_metric("agentic/dropped", float(len(agent_reward) - len(kept)))
            log_metric("agentic/truncated", float(sum(kwargs["agent_truncated"][i] for i in kept)))
            # Batch-level values (the same on every row).
            log_metric("agentic/env_steps", float(kwargs["agent_env_steps"][0]))
            log_metric("agentic/env_s", float(kwargs["agent_env_s"][0]))
            log_metric("agentic/generation_s", float(kwargs["agent_generation_s"][0]))
            for name, value in kwargs["sampling_stats"][0].items():
                log_metric(name, value)
        return list(agent_reward)

    return env_reward


def trainer_arguments(cfg: CurriculumConfig, out_dir: Path, precision: Precision) -> dict[str, Any]:
    """The ``GRPOConfig`` keywords of stage 4 (what ``birdtrain plan`` prints, too).

    ``rollout_func`` receives the step's whole generation batch (tasks x group) at once.
    """
    stage = cfg.stage4
    return {
        "output_dir": str(Path(out_dir) / "trainer"),
        "max_completion_length": stage.max_new_tokens,  # per turn (vLLM's max_tokens)
        **grpo_arguments(
            cfg,
            stage,
            precision,
            sequences=stage.tasks_per_step * stage.num_generations,
            max_model_length=stage.max_context,
        ),
    }


def _load_tasks(tasks: Any, cfg: CurriculumConfig) -> list[Task]:
    if tasks is None:
        tasks = cfg.data.train_suite
    if isinstance(tasks, (str, Path)):
        tasks = load_tasks(tasks, db_dir=cfg.data.db_dir)
    tasks = list(tasks)
    if cfg.data.max_train_tasks is not None:
        tasks = tasks[: cfg.data.max_train_tasks]
    if not tasks:
        raise ValueError("stage 4 needs at least one training task")
    return tasks


def build_trainer(
    cfg: CurriculumConfig,
    *,
    model_path: str,
    out_dir: Path,
    tasks: Sequence[Task],
    envs: Any,
    policy: Any = None,
) -> Any:
    """The configured ``GRPOTrainer`` of stage 4 over ``envs`` (what :func:`run` trains; its
    arguments as there, ``tasks`` already loaded)."""
    silence_trl_experimental()
    # the train extra: imported only where used
    from trl import GRPOConfig

    stage = cfg.stage4
    check_batches("stage4", len(tasks), stage.tasks_per_step, "tasks_per_step")
    model, tokenizer, peft_config, precision = load_for_training(cfg, model_path)
    args = GRPOConfig(**trainer_arguments(cfg, Path(out_dir), precision))
    contexts = stage.tasks_per_step * stage.num_generations  # one step generated together
    with colocated_kv_cache(args, model.name_or_path, contexts=contexts):
        return grpo_trainer_class(stage.share_prompt)(
            model=model,
            processing_class=tokenizer,
            reward_funcs=[make_reward_func()],
            args=args,
            train_dataset=build_dataset(tasks),
            peft_config=peft_config,
            rollout_func=make_rollout_func(
                envs,
                stage,
                policy,
                store=TrajectoryStore(Path(out_dir)),
                categories={t.instance_id: t.category for t in tasks},
                pool=[t.instance_id for t in tasks],
                seed=cfg.seed,
                groups_path=Path(out_dir) / "groups.jsonl",
            ),
        )


def run(
    cfg: CurriculumConfig,
    *,
    model_path: str,
    out_dir: Path,
    tasks: Sequence[Task] | str | Path | None = None,
    envs: Any = None,
    policy: Any = None,
) -> Path:
    """Train with multi-turn GRPO in a vector env and save the merged checkpoint.

    Args:
        cfg: The :class:`~birdtrain.config.CurriculumConfig`; ``cfg.stage4`` drives this stage.
        model_path: The policy to start from (a path or a name :func:`birdtrain.models.resolve_model`
            knows).
        out_dir: Where ``metrics.jsonl`` and ``checkpoint/`` go.
        tasks: Training tasks (a list, a suite name or a JSONL path; default ``cfg.data.train_suite``),
            debugging tasks, BIRD questions, or both.
        envs: A ``gymnasium.vector.VectorEnv`` over these tasks, in autoreset mode
            :data:`birdtrain.rollout.AUTORESET_MODE`; default
            :func:`birdenv.vector.make_vec` (``cfg.stage4.vector``, ``num_envs``, ``reward``): of
            ``BirdCriticEnv``, ``BirdSQLEnv``, or both in ``MixedTaskEnv`` copies. A caller's env
            is left open; ours is closed.
        policy: Optional ``policy(trainer) -> policies.Policy`` acting instead of the trained model
            (a scripted baseline or a test); the loss is still the trained model's.

    Returns:
        ``out_dir/"checkpoint"``.
    """
    stage = cfg.stage4
    out_dir = Path(out_dir)
    task_list = _load_tasks(tasks, cfg)
    own_envs = envs is None
    if own_envs:
        envs = make_vec(
            stage.num_envs,
            tasks=task_list,
            backend=stage.vector,
            reward=stage.reward,
            seed=cfg.seed,
            prompt_options=cfg.prompt.options(),
            vector_kwargs=rollout.VECTOR_KWARGS,
        )
    try:
        trainer = build_trainer(
            cfg, model_path=model_path, out_dir=out_dir, tasks=task_list, envs=envs, policy=policy
        )
        train(trainer)
    finally:
        if own_envs:
            envs.close()
    return finish_stage(trainer, "stage4", out_dir, prompt=cfg.prompt.options())

"""One evaluation from start to end: check the settings, play (or resume), judge, store, write
the files and the summary."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from birdenv.tasks import Task
from birdtrain.config import EvaluationConfig
from birdtrain.errors import OutputWriteError
from birdtrain.evaluate.episodes import REFERENCE_POLICIES, engines_built, play_episodes
from birdtrain.evaluate.files import store_episodes, write_files
from birdtrain.evaluate.progress import EvaluationProgress
from birdtrain.evaluate.scoring import (
    describe_outcomes,
    judge_answers,
    outcomes,
    paper_table,
    summarize,
)
from birdtrain.policies import EndpointPolicy
from birdtrain.prompts import prompt_for
from birdtrain.rollout import submitted
from birdtrain.timeline import Timeline

__all__ = ["episode_settings", "evaluate_policy", "policy_label"]


def policy_label(policy: str) -> str:
    """The name results of ``policy`` go under: an endpoint's model, a checkpoint's folder name.

    >>> policy_label("endpoint:qwen-7b@http://127.0.0.1:8000"), policy_label("runs/a/checkpoint/")
    ('qwen-7b', 'checkpoint')
    """
    if policy.startswith(EndpointPolicy.PREFIX):
        return EndpointPolicy.from_spec(policy).name
    return Path(policy).name or policy


def _kind_of(
    policy: str, tasks: list[Task], mode: str, n: int, temperature: float, ray: bool
) -> type[Task]:
    """The one task class of ``tasks``, once the arguments are known to make sense together."""
    if mode not in ("agent", "single"):
        raise ValueError(f"mode must be 'agent' or 'single', got {mode!r}")
    if mode == "single" and policy in REFERENCE_POLICIES:
        raise ValueError("reference policies act in the environment: use mode='agent'")
    if (
        ray
        and mode == "agent"
        and (policy in REFERENCE_POLICIES or policy.startswith(EndpointPolicy.PREFIX))
    ):
        raise ValueError(
            f"{policy_label(policy)!r} plays in local threads; Ray runs a local model's episodes "
            "and the judging of single answers: evaluate this agent without Ray"
        )
    if not tasks:
        raise ValueError("no tasks to evaluate")
    if n > 1 and temperature == 0:
        raise ValueError("n > 1 samples need temperature > 0 (greedy samples are all the same)")
    kinds = {type(t) for t in tasks}
    if len(kinds) > 1:
        raise ValueError(
            "the tasks mix debugging tasks and BIRD questions: evaluate each kind on its own "
            "(they have different metrics, SR and EX)"
        )
    return kinds.pop()


def episode_settings(policy: str, config: EvaluationConfig) -> dict[str, Any]:
    """What decides an evaluation's episodes (not how many run at once), as JSON values: a
    resumed evaluation must match them, and its ``summary.json`` records them as ``settings``, so
    that whoever reuses finished results (a difficulty estimate's parts) can tell they were made
    the same way."""
    settings = {
        "policy": policy,
        "mode": config.mode,
        "n": config.n,
        "temperature": config.temperature,
        "max_turns": config.max_turns,
        "max_new_tokens": config.max_new_tokens,
        "max_context": config.max_context,
        "engine": config.engine,
        "dtype": config.dtype,
        "prompt": dataclasses.asdict(prompt_for(policy, config.prompt)),
    }
    result: dict[str, Any] = json.loads(json.dumps(settings, default=str))
    return result


def evaluate_policy(
    policy: str,
    *,
    tasks: list[Task],
    out_dir: str | Path,
    config: EvaluationConfig | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Evaluate ``policy`` on ``tasks``; write predictions, verdicts and a summary into ``out_dir``.

    Returns the summary: ``success_rate`` (first sample of each task: SR on debugging tasks, EX on
    BIRD questions) and its 95 % Wilson interval ``ci95`` (percent), ``metric`` (``"SR"`` or
    ``"EX"``), ``task`` (``"debugging"`` or ``"generation"``), ``by_category`` (categories, or
    difficulties), ``pass@k`` and ``pass@k_ci95`` when ``n > 1``, ``outcomes`` (how the episodes
    ended: answers handed in, issue SQL handed back unchanged, unparsed turns), ``label`` (default
    :func:`policy_label`), ``seconds`` and ``time_split``: the wall time split into
    ``generation_s`` (the policy producing turns, a scripted agent's own queries included),
    ``judge_s``, ``env_s`` and ``other_s`` (loading a model, writing files), each instant given to
    the first of those in progress (see :class:`birdtrain.timeline.Timeline`), and ``table``
    (the paper's figures beside this one). BIRD questions also get ``execution_accuracy`` and
    ``by_difficulty`` (the same figures under their own names). How it plays, scores and labels is
    ``config`` (:class:`~birdtrain.config.EvaluationConfig`: the mode, samples, sampling, engine,
    prompt setting, labels), with ``settings`` replacing some of its fields by name
    (``evaluate_policy("oracle", tasks=t, out_dir=d, num_envs=2)``).

    ``ray=True`` uses the Ray cluster at ``RAY_ADDRESS`` (else a local Ray): a local model's
    episodes run in a Ray vector env (environments and their judging on the nodes), and answers of
    ``mode="single"`` are judged by Ray workers. Reference and endpoint agents play in local
    threads, so ``ray=True`` refuses them in ``mode="agent"``.
    """
    config = dataclasses.replace(config or EvaluationConfig(), **settings)
    if config.num_envs < 1:
        raise ValueError(f"num_envs must be >= 1, got {config.num_envs}")
    mode, n = config.mode, config.n
    kind = _kind_of(policy, tasks, mode, n, config.temperature, config.ray)
    prompt = prompt_for(policy, config.prompt)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    label = config.label or policy_label(policy)
    by_id = {t.instance_id: t for t in tasks}
    timeline, started = Timeline(), time.perf_counter()
    settings = episode_settings(policy, config)
    progress = EvaluationProgress(out_dir, settings, list(by_id), n)
    remaining = [t for t in tasks if t.instance_id not in progress.complete]
    built = engines_built()
    try:
        episodes = progress.kept + (
            play_episodes(
                policy,
                remaining,
                dataclasses.replace(config, prompt=prompt),
                timeline=timeline,
                on_episode=progress.save,
            )
            if remaining
            else []
        )
    finally:
        progress.close()
    if mode == "single":
        judge_answers(episodes, by_id, timeline, ray=config.ray)
    else:
        for e in episodes:
            e.pred_sqls = submitted(e.messages)
    order = {t.instance_id: i for i, t in enumerate(tasks)}
    episodes.sort(key=lambda e: (order[e.task_id], e.group))
    try:
        store_episodes(
            config.store_dir or out_dir,
            episodes,
            by_id,
            label=label,
            mode=mode,
            name=f"eval-{progress.id}",
        )
        write_files(out_dir, episodes, by_id, kind)
    except OSError as exc:
        raise OutputWriteError(
            f"cannot write the evaluation's results into {out_dir} ({exc}); its episodes are kept "
            f"in {progress.path}: make room and run the same command to finish"
        ) from exc
    seconds = time.perf_counter() - started
    split = {f"{k}_s": round(v, 2) for k, v in timeline.split(started, started + seconds).items()}
    summary = summarize(episodes, by_id, n)
    summary["outcomes"] = outcomes(episodes, by_id, mode)
    metric = kind.metric
    summary.update(metric=metric, task=kind.skill, suite=config.suite, policy=policy, label=label)
    summary.update(mode=mode, split=config.task_set, seconds=round(seconds, 2), time_split=split)
    summary["prompt"] = dataclasses.asdict(prompt)
    summary["dtype"] = config.dtype
    summary["settings"] = settings
    # 0 when the evaluation generated with an engine an earlier one started (sharing_engines).
    summary["engines_built"] = engines_built() - built
    # An evaluation resumed after an interruption: the tasks it kept, and the seconds spent on
    # them before (``seconds`` and ``time_split`` are this run's own).
    summary["resumed_tasks"] = len(progress.complete)
    summary["earlier_seconds"] = round(progress.earlier_seconds, 2)
    # The figures under the kind's own names too (execution_accuracy, by_difficulty for BIRD).
    summary[kind.metric_name] = summary["success_rate"]
    summary[f"by_{kind.category_name}"] = summary["by_category"]
    summary["table"] = paper_table(label, summary, config.suite)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    progress.finish()
    low, high = summary["ci95"]
    print(
        f"[eval {label}] {metric} {summary['success_rate']:.2f}% ({low:.1f}-{high:.1f}) on "
        f"{summary['n']} tasks in {summary['seconds']} s (generation {split['generation_s']} s, "
        f"environment {split['env_s']} s, judge {split['judge_s']} s, other {split['other_s']} s); "
        f"{describe_outcomes(summary['outcomes'])}"
        + (
            f"; resumed {summary['resumed_tasks']} finished tasks from an interrupted run "
            f"(+{summary['earlier_seconds']} s)"
            if summary["resumed_tasks"]
            else ""
        )
    )
    return summary

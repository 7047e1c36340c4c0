"""Evaluating a policy: Success Rate on BIRD-CRITIC-style tasks by category, execution accuracy on
BIRD questions by difficulty, pass@k, official files.

The tasks decide the environment and the metric: debugging tasks (:class:`birdenv.tasks.Task`) run
in ``BirdCritic-SQLite-v0`` and are judged by the official judge (Success Rate, "SR"); BIRD
questions (:class:`birdenv.bird.BirdTask`) run in ``BirdSQL-SQLite-v0`` with the same prompts'
rendering, tools and formatter, and are scored by execution accuracy ("EX"). One evaluation
holds one kind; a curriculum evaluates both side by side.

Policies behind one interface:

- a model (path, or ``tiny``/``smollm``): agent mode rolls it out through a vector environment with
  :func:`birdtrain.rollout.collect` (the prompts, tool schemas and formatter of training); single
  mode asks once for a ``<solution>``;
- ``endpoint:MODEL@URL``: any OpenAI-compatible chat endpoint, as an agent or single-shot;
- ``oracle`` (submits the gold: 100 % on a validated suite), ``echo`` (submits the issue SQL; on
  BIRD questions, the gold with an extra column: 0 %), ``scripted`` (the offline expert of stage
  2), reference policies for sanity.

Outputs in ``out_dir``: ``predictions.jsonl`` in the official form (``instance_id``, ``pred_sqls``)
that the official evaluator accepts unchanged (for BIRD questions also ``predict.json``, BIRD's
official ``{question_id: "SQL\t----- bird -----\tdb_id"}`` form), ``verdicts.jsonl``,
``summary.json`` and the trajectory store (agent mode), and a table beside the paper's figures.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from birdenv.bird import BIRD_SEPARATOR, DIFFICULTIES, BirdTask
from birdenv.tasks import CATEGORIES, Task
from birdtrain.rollout import Episode, submitted
from birdtrain.trajectory_store import TrajectoryStore, episode_rows

__all__ = ["PAPER_BIRD_RESULTS", "PAPER_RESULTS", "evaluate_policy", "pass_at_k"]

#: Success Rates on BIRD-CRITIC-SQLite (500 tasks) reported by the BIRD-RL paper.
PAPER_RESULTS = [
    ("Gemini-3.1-Pro (agent)", 48.8),
    ("Claude-Opus-4.6 (agent)", 48.2),
    ("BIRD-RL 14B", 48.00),
    ("Claude-Opus-4.6 (single-shot)", 46.2),
    ("BIRD-RL 7B", 44.40),
    ("Qwen3-Coder-480B", 41.6),
    ("BIRD-Fixer-7B", 33.6),
]
#: Execution accuracy on BIRD dev reported by the BIRD-RL paper (its unified model).
PAPER_BIRD_RESULTS = [("BIRD-RL unified 7B", 63.9)]
_REFERENCE = ("oracle", "echo", "scripted")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` successes.

    >>> round(pass_at_k(4, 1, 1), 3), pass_at_k(4, 1, 4), pass_at_k(4, 0, 2)
    (0.25, 1.0, 0.0)
    """
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# -- the policies ------------------------------------------------------------------------------
def _threaded_episodes(
    jobs: list[tuple[Task, int]], num_envs: int, play: Any, prompt: Any = None
) -> list[Episode]:
    """Run ``play(env, task) -> (info, reward, generation seconds)`` for every job, one env per
    worker thread (the envs share the process's replica pool)."""
    from birdenv.envs import BirdCriticEnv, env_class_for

    tasks = [task for task, _ in jobs]
    env_class = env_class_for(type(tasks[0])) if tasks else BirdCriticEnv

    def worker(chunk: list[tuple[Task, int]]) -> list[Episode]:
        env = env_class(tasks=tasks, prompt_options=prompt)
        out = []
        try:
            for task, sample in chunk:
                started = time.perf_counter()
                statement_s: list[float | None] = []
                info, reward, gen_s = play(env, task, statement_s)
                out.append(
                    Episode(
                        task_id=task.instance_id,
                        group=sample,
                        messages=info["messages"],
                        reward=reward,
                        verdict=info.get("verdict"),
                        env_s=time.perf_counter() - started - gen_s,
                        generation_s=gen_s,
                        statement_s=statement_s,
                    )
                )
        finally:
            env.close()
        return out

    chunks = [jobs[i::num_envs] for i in range(min(num_envs, len(jobs)))]
    with concurrent.futures.ThreadPoolExecutor(len(chunks)) as pool:
        return [e for part in pool.map(worker, chunks) for e in part]


def _reference_episodes(
    policy: str, jobs: list[tuple[Task, int]], *, max_turns: int, num_envs: int
) -> list[Episode]:
    """A reference agent: ``oracle`` and ``echo`` are :mod:`birdenv.agents` (on BIRD questions,
    :func:`birdtrain.data.bird.bird_reference_turns`); ``scripted`` is stage 2's offline expert,
    which explores with real evidence before it submits the known fix (or the gold query)."""
    from birdenv.agents import AGENTS
    from birdenv.replicas.pool import default_pool
    from birdtrain.data.bird import BirdExpert, bird_reference_turns, gather_bird_evidence
    from birdtrain.data.evidence import gather_evidence
    from birdtrain.data.tool_use import OfflineExpert

    def play(env: Any, task: Task, statement_s: list) -> tuple[dict, float, float]:
        bird = isinstance(task, BirdTask)
        if policy == "scripted" and bird:
            act = BirdExpert(task, gather_bird_evidence(task, default_pool()), max_turns).act
        elif policy == "scripted":
            act = OfflineExpert(task, gather_evidence(task, default_pool()), max_turns).act
        elif bird:
            planned = iter(bird_reference_turns(policy, task))
            act = lambda observation: next(planned)  # noqa: E731 - the plan ignores observations
        else:
            planned = iter(AGENTS[policy]().turns(task))
            act = lambda observation: next(planned)  # noqa: E731 - the plan ignores observations
        observation, info = env.reset(options={"task_id": task.instance_id})
        reward = 0.0
        for _ in range(max_turns):
            observation, reward, terminated, _, info = env.step(act(observation))
            statement_s.append(info.get("elapsed"))
            if terminated:
                break
        return info, reward, 0.0

    return _threaded_episodes(jobs, num_envs, play)


def _endpoint_episodes(
    spec: str,
    jobs: list[tuple[Task, int]],
    *,
    max_turns: int,
    max_new_tokens: int,
    temperature: float,
    num_envs: int,
    prompt: Any = None,
) -> list[Episode]:
    """An OpenAI-compatible model as an agent, one conversation per env."""
    from birdtrain.policies import EndpointPolicy

    agent = EndpointPolicy.from_spec(spec)

    def play(env: Any, task: Task, statement_s: list) -> tuple[dict, float, float]:
        _, info = env.reset(options={"task_id": task.instance_id})
        reward, gen_s = 0.0, 0.0
        for _ in range(max_turns):
            started = time.perf_counter()
            turn = agent.turn(
                info["messages"], max_new_tokens=max_new_tokens, temperature=temperature
            )
            gen_s += time.perf_counter() - started
            _, reward, terminated, _, info = env.step(turn)
            statement_s.append(info.get("elapsed"))
            if terminated:
                break
        return info, reward, gen_s

    return _threaded_episodes(jobs, num_envs, play, prompt)


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
    prompt: Any = None,
) -> tuple[list[Episode], dict[str, float]]:
    """A local model as an agent, rolled out through a vector env exactly as in stage 4."""
    from birdenv.vector import make_vec
    from birdtrain.policies import generation_policy
    from birdtrain.rollout import collect

    generator = generation_policy(model_path, engine=engine)
    envs = make_vec(
        min(num_envs, len(tasks) * n),
        tasks=tasks,
        asynchronous=num_envs > 1,
        max_episode_steps=max_turns,
        prompt_options=prompt,
    )
    try:
        rollouts = collect(
            envs,
            generator,
            [t.instance_id for t in tasks],
            num_generations=n,
            max_turns=max_turns,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            max_context=32768,
        )
    finally:
        envs.close()
    return list(rollouts), {"generation_s": rollouts.generation_s, "env_s": rollouts.env_s}


def _single_answers(
    policy: str,
    tasks: list[Task],
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    engine: str,
    prompt: Any = None,
) -> list[Episode]:
    """One ``<solution>`` per sample from a model or an endpoint."""
    from birdtrain.prompts import parse_solution, single_turn_prompt

    jobs = [(t, s) for t in tasks for s in range(n)]
    prompts = [[{"role": "user", "content": single_turn_prompt(t, prompt)}] for t, _ in jobs]
    started = time.perf_counter()
    if policy.startswith("endpoint:"):
        from birdtrain.policies import EndpointPolicy

        agent = EndpointPolicy.from_spec(policy)
        texts = [
            agent.answer(p, max_new_tokens=max_new_tokens, temperature=temperature) for p in prompts
        ]
    else:
        from birdtrain.policies import generation_policy

        generator = generation_policy(policy, engine=engine)
        tokenizer = generator.tokenizer
        texts = []
        for i in range(0, len(prompts), 8):
            batch = [
                tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
                for p in prompts[i : i + 8]
            ]
            # transformers 5 returns a BatchEncoding (a mapping, not a dict) for tokenize=True.
            batch = [list(ids["input_ids"] if hasattr(ids, "keys") else ids) for ids in batch]
            for ids, _ in generator.generate(
                batch, max_new_tokens=max_new_tokens, temperature=temperature
            ):
                texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    gen_s = (time.perf_counter() - started) / max(len(jobs), 1)
    return [
        Episode(
            task_id=t.instance_id,
            group=s,
            messages=[*p, {"role": "assistant", "content": text}],
            pred_sqls=parse_solution(text),
            generation_s=gen_s,
        )
        for (t, s), p, text in zip(jobs, prompts, texts, strict=True)
    ]


# -- the evaluation ----------------------------------------------------------------------------
def _summarize(episodes: list[Episode], by_id: dict[str, Task], n: int) -> dict[str, Any]:
    by_task: dict[str, list[bool]] = defaultdict(list)
    category = {}
    for e in episodes:
        by_task[e.task_id].append(e.passed)
        category[e.task_id] = by_id[e.task_id].category
    first = {tid: results[0] for tid, results in by_task.items()}
    by_category: dict[str, dict[str, Any]] = {}
    known = (*CATEGORIES, *DIFFICULTIES)
    for cat in [c for c in known if c in category.values()] + sorted(
        set(category.values()) - set(known)
    ):
        ids = [t for t, c in category.items() if c == cat]
        by_category[cat] = {
            "n": len(ids),
            "success_rate": 100 * sum(first[t] for t in ids) / len(ids),
        }
    summary = {
        "n": len(by_task),
        "samples": n,
        "success_rate": 100 * sum(first.values()) / max(len(first), 1),
        "by_category": by_category,
    }
    if n > 1:
        for k in sorted({1, n}):
            summary[f"pass@{k}"] = (
                100 * sum(pass_at_k(n, sum(r), k) for r in by_task.values()) / len(by_task)
            )
    return summary


def _table(label: str, summary: dict[str, Any], suite: str) -> str:
    metric = summary.get("metric", "SR")
    if metric == "EX":
        rows = [(name, f"{ex:.1f}", "BIRD dev (paper)") for name, ex in PAPER_BIRD_RESULTS]
    else:
        rows = [(name, f"{sr:.1f}", "BIRD-CRITIC-SQLite 500 (paper)") for name, sr in PAPER_RESULTS]
    rows.append(
        (
            f"{label} (measured here)",
            f"{summary['success_rate']:.1f}",
            f"{suite} ({summary['n']} tasks)",
        )
    )
    rows.sort(key=lambda r: -float(r[1]))
    width = max(len(r[0]) for r in rows)
    lines = [
        f"{'policy':<{width}}  {metric + ' %':>6}  tasks",
        f"{'-' * width}  {'-' * 6}  -----",
    ]
    lines += [f"{name:<{width}}  {sr:>6}  {where}" for name, sr, where in rows]
    cats = ", ".join(
        f"{c} {v['success_rate']:.1f}% (n={v['n']})" for c, v in summary["by_category"].items()
    )
    lines.append(f"\n{label} by {'difficulty' if metric == 'EX' else 'category'}: {cats}")
    for key in ("pass@1", f"pass@{summary['samples']}"):
        if key in summary:
            lines.append(f"{label} {key}: {summary[key]:.1f}%")
    return "\n".join(lines)


def evaluate_policy(
    policy: str,
    *,
    tasks: list[Task],
    out_dir: str | Path,
    mode: str = "agent",
    n: int = 1,
    temperature: float = 0.0,
    max_turns: int = 5,
    max_new_tokens: int = 512,
    num_envs: int = 8,
    label: str | None = None,
    suite: str = "tasks",
    store_dir: str | Path | None = None,
    engine: str = "auto",
    prompt: Any = None,
    task_set: str = "heldout",
) -> dict[str, Any]:
    """Evaluate ``policy`` on ``tasks``; write predictions, verdicts and a summary into ``out_dir``.

    Returns the summary: ``success_rate`` (first sample of each task: SR on debugging tasks, EX on
    BIRD questions), ``metric`` (``"SR"`` or ``"EX"``), ``task`` (``"debugging"`` or
    ``"generation"``), ``by_category`` (categories, or difficulties), ``pass@k`` when ``n > 1``,
    the time split, and ``table`` (the paper's figures beside this one). BIRD questions also get
    ``execution_accuracy`` and ``by_difficulty`` (the same figures under their own names).
    A local model generates with ``engine`` (``"auto"``: vLLM when installed with CUDA, else
    transformers; see :func:`birdtrain.policies.generation_policy`). ``prompt`` is the prompt
    setting (:class:`birdenv.schema.PromptOptions`; default: the benchmark's full schema), which
    must be the one the policy was trained with; ``task_set`` (``"heldout"`` or ``"train"``, the
    summary's ``split``) says which tasks these are, for the report.
    """
    if mode not in ("agent", "single"):
        raise ValueError(f"mode must be 'agent' or 'single', got {mode!r}")
    if not tasks:
        raise ValueError("no tasks to evaluate")
    kinds = {type(t) for t in tasks}
    if len(kinds) > 1:
        raise ValueError(
            "the tasks mix debugging tasks and BIRD questions: evaluate each kind on its own "
            "(they have different metrics, SR and EX)"
        )
    (kind,) = kinds
    if n > 1 and temperature == 0:
        raise ValueError("n > 1 samples need temperature > 0 (greedy samples are all the same)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    label = label or policy
    by_id = {t.instance_id: t for t in tasks}
    started = time.perf_counter()
    split = {"generation_s": 0.0, "env_s": 0.0, "judge_s": 0.0}
    if mode == "agent":
        jobs = [(t, s) for t in tasks for s in range(n)]
        if policy in _REFERENCE or policy.startswith("endpoint:"):
            if policy in _REFERENCE:
                episodes = _reference_episodes(policy, jobs, max_turns=max_turns, num_envs=num_envs)
            else:
                episodes = _endpoint_episodes(
                    policy,
                    jobs,
                    max_turns=max_turns,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    num_envs=num_envs,
                    prompt=prompt,
                )
            split["generation_s"] = sum(e.generation_s for e in episodes)
            split["env_s"] = sum(e.env_s for e in episodes)
        else:
            episodes, times = _model_episodes(
                policy,
                tasks,
                n=n,
                max_turns=max_turns,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                num_envs=num_envs,
                engine=engine,
                prompt=prompt,
            )
            split.update(times)
        for e in episodes:
            e.pred_sqls = submitted(e.messages)
            if (
                "generation_s" not in split
                or policy in _REFERENCE
                or policy.startswith("endpoint:")
            ):
                split["generation_s"] += e.generation_s
                split["env_s"] += e.env_s
        judge_times = [e.verdict["timings"].get("total", 0.0) for e in episodes if e.verdict]
        split["judge_s"] = sum(judge_times)
        store = TrajectoryStore(store_dir or out_dir)
        store.append(
            row
            for e in episodes
            for row in episode_rows(e, category=by_id[e.task_id].category, run=label, stage="eval")
        )
    else:
        if policy in _REFERENCE:
            raise ValueError("reference policies act in the environment: use mode='agent'")
        episodes = _single_answers(
            policy,
            tasks,
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            engine=engine,
            prompt=prompt,
        )
        split["generation_s"] = sum(e.generation_s for e in episodes)
        judge_started = time.perf_counter()
        # The official rules (for BIRD: the gold on the prediction's state), as evaluators score.
        verdicts = kind.judge_many(
            [(by_id[e.task_id], e.pred_sqls) for e in episodes], official=True
        )
        for e, verdict in zip(episodes, verdicts, strict=True):
            e.verdict = verdict.to_dict()
        split["judge_s"] = time.perf_counter() - judge_started
    order = {t.instance_id: i for i, t in enumerate(tasks)}
    episodes.sort(key=lambda e: (order[e.task_id], e.group))
    with (out_dir / "predictions.jsonl").open("w") as fh:
        for e in episodes:
            if e.group == 0:
                fh.write(json.dumps({"instance_id": e.task_id, "pred_sqls": e.pred_sqls}) + "\n")
    with (out_dir / "verdicts.jsonl").open("w") as fh:
        for e in episodes:
            fh.write(
                json.dumps(
                    {
                        "instance_id": e.task_id,
                        "sample": e.group,
                        "category": by_id[e.task_id].category,
                        "status": "success" if e.passed else "failed",
                        "pred_sqls": e.pred_sqls,
                        "verdict": e.verdict,
                    },
                    default=str,
                )
                + "\n"
            )
    if kind is BirdTask:
        official = {
            e.task_id: f"{(e.pred_sqls or [''])[-1]}{BIRD_SEPARATOR}{by_id[e.task_id].db_id}"
            for e in episodes
            if e.group == 0
        }
        (out_dir / "predict.json").write_text(json.dumps(official, indent=2))
    summary = _summarize(episodes, by_id, n)
    metric = kind.metric
    summary.update(metric=metric, task=kind.skill, suite=suite)
    # The figures under the kind's own names too (execution_accuracy, by_difficulty for BIRD).
    summary[kind.metric_name] = summary["success_rate"]
    summary[f"by_{kind.category_name}"] = summary["by_category"]
    summary.update(
        policy=policy,
        label=label,
        mode=mode,
        split=task_set,
        seconds=round(time.perf_counter() - started, 2),
        time_split={k: round(v, 2) for k, v in split.items()},
    )
    summary["table"] = _table(label, summary, suite)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"[eval {label}] {metric} {summary['success_rate']:.2f}% on {summary['n']} tasks in {summary['seconds']} s "
        f"(generation {split['generation_s']:.1f} s, environment {split['env_s']:.1f} s, judge {split['judge_s']:.1f} s)"
    )
    return summary

"""Evaluating a policy: Success Rate on BIRD-CRITIC-style tasks by category, execution accuracy on
BIRD questions by difficulty, pass@k, 95 % intervals, official files.

The tasks decide the environment and the metric: debugging tasks (:class:`birdenv.tasks.Task`) run
in ``BirdCritic-SQLite-v0`` and are judged by the official judge (Success Rate, "SR"); BIRD
questions (:class:`birdenv.tasks.BirdTask`) run in ``BirdSQL-SQLite-v0`` with the same prompts'
rendering, tools and formatter, and are scored by execution accuracy ("EX"). One evaluation
holds one kind; a curriculum evaluates both side by side.

Policies behind one interface:

- a model (path, or ``tiny``/``smollm``): agent mode rolls it out through a vector environment with
  :func:`birdtrain.rollout.collect` (the prompts, tool schemas and formatter of training); single
  mode asks once for a ``<solution>``;
- ``endpoint:MODEL@URL``: any OpenAI-compatible chat endpoint
  (:class:`~birdtrain.policies.EndpointPolicy`), as an agent or single-shot, labelled ``MODEL``;
- ``oracle`` (submits the gold: 100 % on a validated suite), ``echo`` (submits the issue SQL; on
  BIRD questions, the gold with an extra column: 0 %), ``scripted`` (the offline expert of stage
  2), reference policies for sanity.

Outputs in ``out_dir``: ``predictions.jsonl`` in the official form (``instance_id``, ``pred_sqls``)
that the official evaluator accepts unchanged (for BIRD questions also ``predict.json``, BIRD's
official ``{question_id: "SQL\\t----- bird -----\\tdb_id"}`` form), ``verdicts.jsonl``,
``summary.json`` and the trajectory store (agent mode), and a table beside the paper's figures.
While it runs, each finished episode is saved in ``episodes.partial.jsonl`` (see
:class:`EvaluationProgress`): an evaluation that is interrupted resumes where it stopped when it is
run again into the same folder with the same settings.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from birdenv.errors import OutputWriteError
from birdenv.judge import score_many
from birdenv.tasks import CATEGORIES, Task
from birdenv.tasks.bird import BIRD_SEPARATOR, DIFFICULTIES, BirdTask
from birdenv.tools import has_tool_call
from birdtrain.policies import EndpointPolicy
from birdtrain.prompts import prompt_for
from birdtrain.rollout import Episode, submitted
from birdtrain.stats import pass_at_k, wilson_interval
from birdtrain.timeline import Timeline
from birdtrain.trajectory_store import TrajectoryStore, episode_rows

__all__ = [
    "PAPER_BIRD_RESULTS",
    "PAPER_RESULTS",
    "PROGRESS_FILE",
    "EvaluationProgress",
    "compare_evaluations",
    "describe_outcomes",
    "evaluate_policy",
    "policy_label",
    "read_verdicts",
]

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
# An agent: the next turn from the last observation and info (``info["messages"]``).
Act = Callable[[str, dict[str, Any]], str]
#: The file in an evaluation's folder that holds its finished episodes until its summary is written.
PROGRESS_FILE = "episodes.partial.jsonl"


class EvaluationProgress:
    """The finished episodes of an evaluation in ``out_dir``, saved one line each as they end, so
    that an interrupted evaluation (a killed process, a machine that went away) resumes where it
    stopped instead of from the start.

    The file's first line holds the evaluation's ``settings``; resuming under other settings is an
    error that names the ones that differ. Each further line is one episode and the seconds its
    run had spent when it was saved. On opening, :attr:`kept` are the episodes of tasks whose
    ``n`` samples were all saved (those of a task cut short are sampled again), and
    :attr:`earlier_seconds` the time earlier runs had spent when they saved their last episode; the
    file is rewritten to hold only those. A file without episodes (a run that failed before its
    first) holds nothing to resume, whatever its settings. A last line cut short by the
    interruption is dropped; a broken line elsewhere is an error naming it. An episode that broke
    (``dropped``, an environment error) is not saved, so a resumed run plays it again. A file that
    cannot be written (a full disk) raises :class:`~birdenv.errors.OutputWriteError` and keeps the
    lines saved before. :meth:`close` stops saving; :meth:`finish` removes the file once the
    summary is written. :attr:`id` names the evaluation across its resumptions (its part of the
    trajectory store is written under it, so a resumed run that stores again replaces that part).
    """

    def __init__(
        self, out_dir: Path, settings: dict[str, Any], task_ids: list[str], n: int
    ) -> None:
        self.path = out_dir / PROGRESS_FILE
        self.settings = json.loads(json.dumps(settings, default=str))
        self.kept: list[Episode] = []
        self._kept_rows: list[dict[str, Any]] = []
        self.earlier_seconds = 0.0
        self.id = uuid.uuid4().hex[:12]
        self._run = 0
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        if self.path.is_file():
            self._read(set(task_ids), n)
        tmp = self.path.with_suffix(".tmp")
        try:
            with tmp.open("w") as fh:
                fh.write(json.dumps({"settings": self.settings, "id": self.id}) + "\n")
                for row in self._kept_rows:
                    fh.write(json.dumps(row) + "\n")
            os.replace(tmp, self.path)  # the file as it was until the new one is whole
            self._fh = self.path.open("a", buffering=1)  # one line each: a kill loses no whole line
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._unwritable(exc) from exc

    def _read(self, task_ids: set[str], n: int) -> None:
        lines = self.path.read_text().splitlines()
        rows: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
        seconds: dict[int, float] = {}
        for number, line in enumerate(lines[1:], start=2):
            try:
                row = json.loads(line)
                episode = row["episode"]
                run, spent = int(row["run"]), float(row["seconds"])
                task_id, group = episode["task_id"], int(episode["group"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                if number == len(lines):
                    break  # the line being written when the run was interrupted
                raise ValueError(f"{self.path}:{number}: not a saved episode ({exc})") from None
            if task_id in task_ids and 0 <= group < n:
                rows[task_id][group] = row
            seconds[run] = max(seconds.get(run, 0.0), spent)
        if not seconds:
            return  # no episode saved: nothing to resume, whatever the settings were
        try:
            header = json.loads(lines[0])
            saved, self.id = header["settings"], str(header.get("id", self.id))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{self.path}:1: not the progress of an evaluation") from None
        differ = [
            f"{key}: {saved.get(key)!r} there, {value!r} here"
            for key, value in self.settings.items()
            if saved.get(key) != value
        ]
        if differ:
            raise ValueError(
                f"{self.path} holds an interrupted evaluation with other settings "
                f"({'; '.join(differ)}); run it with the same settings to resume it, or remove "
                "the file (or write to another folder) to start over"
            )
        self._run = max(seconds) + 1
        self.earlier_seconds = sum(seconds.values())
        self._kept_rows = [
            groups[g] for groups in rows.values() if len(groups) == n for g in range(n)
        ]
        self.kept = [Episode.from_dict(row["episode"]) for row in self._kept_rows]

    @property
    def complete(self) -> set[str]:
        """Tasks whose every sample was kept from an earlier run."""
        return {e.task_id for e in self.kept}

    def save(self, episode: Episode) -> None:
        """Save a finished episode (from any thread); one that broke is left to be played again."""
        if episode.dropped:
            return
        row = {
            "run": self._run,
            "seconds": round(time.perf_counter() - self._started, 3),
            "episode": dataclasses.asdict(episode),
        }
        line = json.dumps(row, default=str) + "\n"
        with self._lock:
            try:
                self._fh.write(line)
            except OSError as exc:
                raise self._unwritable(exc) from exc

    def _unwritable(self, exc: OSError) -> OutputWriteError:
        return OutputWriteError(
            f"cannot save the evaluation's progress in {self.path} ({exc.strerror or exc}); the "
            "episodes saved before are kept: make room and run the same command to resume"
        )

    def close(self) -> None:
        """Stop saving (the episodes are all in, or the evaluation failed: the file stays)."""
        # Every whole line is written already; what a failed write left in the buffer is a torn
        # line that a resumed run drops, and flushing it again must not hide the first error.
        with contextlib.suppress(OSError):
            self._fh.close()

    def finish(self) -> None:
        """The evaluation's files are written: the progress file has served its purpose."""
        self.close()
        self.path.unlink(missing_ok=True)


def policy_label(policy: str) -> str:
    """The name results of ``policy`` go under: an endpoint's model, a checkpoint's folder name.

    >>> policy_label("endpoint:qwen-7b@http://127.0.0.1:8000"), policy_label("runs/a/checkpoint/")
    ('qwen-7b', 'checkpoint')
    """
    if policy.startswith(EndpointPolicy.PREFIX):
        return EndpointPolicy.from_spec(policy).name
    return Path(policy).name or policy


# -- agents that act in a plain env, one per worker thread --------------------------------------
def _reference_agent(policy: str, max_turns: int) -> Callable[[Task], Act]:
    """``oracle`` and ``echo`` are :mod:`birdenv.agents` (on BIRD questions,
    :func:`birdtrain.data.bird.bird_reference_turns`); ``scripted`` is stage 2's offline expert,
    which explores with real evidence before it submits the known fix (or the gold query)."""
    from birdenv.agents import AGENTS
    from birdenv.replicas.pool import default_pool
    from birdtrain.data.bird import BirdExpert, bird_reference_turns, gather_bird_evidence
    from birdtrain.data.evidence import gather_evidence
    from birdtrain.data.tool_use import OfflineExpert

    def agent(task: Task) -> Act:
        bird = isinstance(task, BirdTask)
        if policy == "scripted" and bird:
            return BirdExpert(task, gather_bird_evidence(task, default_pool()), max_turns).act
        if policy == "scripted":
            return OfflineExpert(task, gather_evidence(task, default_pool()), max_turns).act
        planned = iter(bird_reference_turns(policy, task) if bird else AGENTS[policy]().turns(task))
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
    """``n`` episodes of every task, one plain env per worker thread (sharing one replica pool),
    with the prompt setting ``prompt``; ``on_episode`` sees each as it ends."""
    from birdenv.envs import env_class_for

    env_class = env_class_for(type(tasks[0]))
    jobs = [(t, s) for t in tasks for s in range(n)]

    def worker(chunk: list[tuple[Task, int]]) -> list[Episode]:
        env = env_class(tasks=tasks, prompt_options=prompt)
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
    from birdenv.vector import make_vec
    from birdtrain.policies import generation_policy
    from birdtrain.rollout import VECTOR_KWARGS, collect

    # The env workers fork before the engine starts: a vLLM engine's threads, sockets and locks
    # do not survive a fork.
    envs = make_vec(
        min(num_envs, len(tasks) * n),
        tasks=tasks,
        backend="ray" if ray else ("async" if num_envs > 1 else "sync"),
        max_episode_steps=max_turns,
        prompt_options=prompt,
        vector_kwargs=VECTOR_KWARGS,
    )
    try:
        generator = generation_policy(
            model_path, engine=engine, engine_options=engine_options, dtype=dtype
        )
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
    from birdtrain.prompts import parse_solution, single_turn_prompt

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
    from birdtrain.policies import generation_policy

    generator = generation_policy(policy, engine=engine, engine_options=engine_options, dtype=dtype)
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


def _judge(
    episodes: list[Episode],
    by_id: dict[str, Task],
    kind: type[Task],
    timeline: Timeline,
    *,
    ray: bool,
) -> None:
    """Judge single-mode answers: SR by the official judge, or BIRD's official EX rule (with
    ``ray``: on Ray workers over the cluster)."""
    with timeline.span("judge"):
        # The official rules (for BIRD: the gold on the prediction's state), as evaluators score.
        verdicts = score_many(
            [(by_id[e.task_id], e.pred_sqls) for e in episodes], official=True, ray=ray
        )
    for episode, verdict in zip(episodes, verdicts, strict=True):
        episode.verdict = verdict.to_dict()


# -- the evaluation ----------------------------------------------------------------------------
def _rate(passed: float, n: int) -> dict[str, Any]:
    """A success rate in percent with its 95 % Wilson interval."""
    low, high = wilson_interval(passed, n)
    return {"n": n, "success_rate": 100 * passed / n, "ci95": [100 * low, 100 * high]}


def _summarize(episodes: list[Episode], by_id: dict[str, Task], n: int) -> dict[str, Any]:
    by_task: dict[str, list[bool]] = defaultdict(list)
    for e in episodes:
        by_task[e.task_id].append(e.passed)
    category = {t: by_id[t].category for t in by_task}
    first = {t: results[0] for t, results in by_task.items()}
    known = (*CATEGORIES, *DIFFICULTIES)
    order = [c for c in known if c in category.values()]
    order += sorted(set(category.values()) - set(known))
    summary = _rate(sum(first.values()), len(first))
    summary["samples"] = n
    summary["by_category"] = {
        cat: _rate(
            sum(first[t] for t in first if category[t] == cat), list(category.values()).count(cat)
        )
        for cat in order
    }
    if n > 1:
        for k in sorted({1, n}):
            rate = _rate(sum(pass_at_k(n, sum(r), k) for r in by_task.values()), len(by_task))
            summary[f"pass@{k}"], summary[f"pass@{k}_ci95"] = rate["success_rate"], rate["ci95"]
    return summary


def _outcomes(episodes: list[Episode], by_id: dict[str, Task], mode: str) -> dict[str, int]:
    """How the episodes ended, counted over every sample: what a success rate leaves out.

    ``submitted`` episodes handed in an answer (a ``submit_solution`` call, or a ``<solution>``
    in single mode); on debugging tasks ``unchanged`` of those handed back the task's own issue
    SQL, whitespace aside (the "fix" that changes nothing). In agent mode ``turns`` counts the
    policy's turns and ``unparsed_turns`` those holding no tool call that parses.
    """

    def words(sqls: list[str]) -> list[str]:
        return [" ".join(sql.split()) for sql in sqls]

    answered = [e for e in episodes if e.pred_sqls]
    counts = {"episodes": len(episodes), "submitted": len(answered)}
    if all(isinstance(by_id[e.task_id], Task) for e in episodes):
        counts["unchanged"] = sum(
            words(e.pred_sqls) == words(by_id[e.task_id].issue_sql) for e in answered
        )
    if mode == "agent":
        turns = [m["content"] for e in episodes for m in e.messages if m["role"] == "assistant"]
        counts["turns"] = len(turns)
        counts["unparsed_turns"] = sum(not has_tool_call(text) for text in turns)
    return counts


def describe_outcomes(outcomes: dict[str, int]) -> str:
    """One line for :func:`_outcomes`'s counts.

    >>> describe_outcomes({"episodes": 69, "submitted": 51, "unchanged": 19, "turns": 206,
    ...                    "unparsed_turns": 50})
    '51/69 submitted (19 unchanged), 50/206 turns unparsed'
    """
    line = f"{outcomes['submitted']}/{outcomes['episodes']} submitted"
    if "unchanged" in outcomes:
        line += f" ({outcomes['unchanged']} unchanged)"
    if "turns" in outcomes:
        line += f", {outcomes['unparsed_turns']}/{outcomes['turns']} turns unparsed"
    return line


def _write_files(
    out_dir: Path, episodes: list[Episode], by_id: dict[str, Task], kind: type[Task]
) -> None:
    """``predictions.jsonl`` (official form, first samples), ``verdicts.jsonl``, and for BIRD
    questions ``predict.json``."""
    firsts = [e for e in episodes if e.group == 0]
    with (out_dir / "predictions.jsonl").open("w") as fh:
        for e in firsts:
            fh.write(json.dumps({"instance_id": e.task_id, "pred_sqls": e.pred_sqls}) + "\n")
    with (out_dir / "verdicts.jsonl").open("w") as fh:
        for e in episodes:
            row = {
                "instance_id": e.task_id,
                "sample": e.group,
                "category": by_id[e.task_id].category,
                "status": "success" if e.passed else "failed",
                "pred_sqls": e.pred_sqls,
                "verdict": e.verdict,
            }
            fh.write(json.dumps(row, default=str) + "\n")
    if kind is BirdTask:
        official = {
            e.task_id: f"{(e.pred_sqls or [''])[-1]}{BIRD_SEPARATOR}{by_id[e.task_id].db_id}"
            for e in firsts
        }
        (out_dir / "predict.json").write_text(json.dumps(official, indent=2))


def read_verdicts(out_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of an evaluation's ``verdicts.jsonl`` (one per sample of each task).

    Raises ``ValueError`` naming the file and line when it is missing or a row is broken.
    """
    path = Path(out_dir) / "verdicts.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: no such file; give the --out folder of a `birdtrain eval`")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            if not isinstance(row["instance_id"], str) or row["status"] not in (
                "success",
                "failed",
            ):
                raise ValueError("instance_id or status has the wrong type")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a verdict row ({exc})") from None
        rows.append(row)
    return rows


def compare_evaluations(a_dir: str | Path, b_dir: str | Path) -> dict[str, Any]:
    """Evaluation ``b_dir`` against evaluation ``a_dir``, task by task, on the tasks both hold.

    Returns :func:`birdtrain.stats.paired_difference` of their samples' outcomes (every sample,
    not only the first), with each side's ``labels`` and ``samples`` per task from their
    summaries. Use it to ask whether training changed a policy: evaluate both checkpoints on the
    same tasks, with several samples at a temperature when the tasks are few.
    """
    from birdtrain.stats import paired_difference

    outcomes: list[dict[str, list[bool]]] = []
    labels, samples = [], []
    for out_dir in (a_dir, b_dir):
        by_task: dict[str, list[bool]] = defaultdict(list)
        for row in read_verdicts(out_dir):
            by_task[row["instance_id"]].append(row["status"] == "success")
        outcomes.append(dict(by_task))
        summary_path = Path(out_dir) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        labels.append(summary.get("label", Path(out_dir).name))
        samples.append(max(len(v) for v in by_task.values()) if by_task else 0)
    result = paired_difference(outcomes[0], outcomes[1])
    result.update(labels=labels, samples=samples)
    return result


def _table(label: str, summary: dict[str, Any], suite: str) -> str:
    metric = summary.get("metric", "SR")
    if metric == "EX":
        rows = [(name, f"{ex:.1f}", "BIRD dev (paper)") for name, ex in PAPER_BIRD_RESULTS]
    else:
        rows = [(name, f"{sr:.1f}", "BIRD-CRITIC-SQLite 500 (paper)") for name, sr in PAPER_RESULTS]
    low, high = summary["ci95"]
    rows.append(
        (
            f"{label} (measured here)",
            f"{summary['success_rate']:.1f}",
            f"{suite} ({summary['n']} tasks; 95 % interval {low:.1f}-{high:.1f})",
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
            low, high = summary[f"{key}_ci95"]
            lines.append(f"{label} {key}: {summary[key]:.1f}% (95 % interval {low:.1f}-{high:.1f})")
    return "\n".join(lines)


def _kind_of(
    policy: str, tasks: list[Task], mode: str, n: int, temperature: float, ray: bool
) -> type[Task]:
    """The one task class of ``tasks``, once the arguments are known to make sense together."""
    if mode not in ("agent", "single"):
        raise ValueError(f"mode must be 'agent' or 'single', got {mode!r}")
    if mode == "single" and policy in _REFERENCE:
        raise ValueError("reference policies act in the environment: use mode='agent'")
    if (
        ray
        and mode == "agent"
        and (policy in _REFERENCE or policy.startswith(EndpointPolicy.PREFIX))
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


def _episodes(
    policy: str, tasks: list[Task], *, mode: str, timeline: Timeline, **settings: Any
) -> list[Episode]:
    """The policy's episodes: answers (single mode), or agents in envs (reference policies and
    endpoints in plain envs on threads, local models in a vector env through ``collect``)."""
    sampling = {k: settings[k] for k in ("max_new_tokens", "temperature")}
    if mode == "single":
        keys = ("n", "engine", "prompt", "engine_options", "dtype", "num_envs", "on_episode")
        single = {k: settings[k] for k in keys}
        return _single_episodes(policy, tasks, timeline=timeline, **single, **sampling)
    threads = {k: settings[k] for k in ("n", "num_envs", "max_turns", "prompt", "on_episode")}
    if policy in _REFERENCE:
        agent = _reference_agent(policy, settings["max_turns"])
        return _threaded(tasks, agent, timeline, **threads)
    if policy.startswith(EndpointPolicy.PREFIX):
        return _threaded(tasks, _endpoint_agent(policy, **sampling), timeline, **threads)
    return _model_episodes(policy, tasks, timeline=timeline, **settings)


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
    ray: bool = False,
    max_context: int = 32768,
    engine_options: dict[str, Any] | None = None,
    dtype: str = "float32",
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
    ``by_difficulty`` (the same figures under their own names). A local model generates with
    ``engine`` (see :func:`birdtrain.policies.generation_policy`). ``prompt`` is the prompt
    setting (:class:`birdenv.schema.PromptOptions`, or a mapping of some of its options over the
    checkpoint's), which must be the one the policy was trained with: by default the one a
    training stage recorded in its checkpoint, else the benchmark's full schema (see
    :func:`birdtrain.prompts.prompt_for`; the summary's ``prompt``); ``task_set``
    (``"heldout"`` or ``"train"``, the summary's ``split``) says which tasks these are, for the
    report. ``engine_options`` go to the vLLM engine (``gpu_memory_utilization``,
    ``max_model_len``); an agent's episode ends when its context reaches ``max_context`` tokens.
    ``dtype`` is what a local model computes in with the transformers engine (``"bfloat16"``:
    under autocast, as a stage trained with it samples; the summary's ``dtype``). ``num_envs``
    episodes are played at once: the vector env's environments (or worker threads) in agent mode,
    the prompts of each generated batch in single mode.

    ``ray=True`` uses the Ray cluster at ``RAY_ADDRESS`` (else a local Ray): a local model's
    episodes run in a Ray vector env (environments and their judging on the nodes), and answers of
    ``mode="single"`` are judged by Ray workers. Reference and endpoint agents play in local
    threads, so ``ray=True`` refuses them in ``mode="agent"``.
    """
    if num_envs < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    kind = _kind_of(policy, tasks, mode, n, temperature, ray)
    prompt = prompt_for(policy, prompt)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    label = label or policy_label(policy)
    by_id = {t.instance_id: t for t in tasks}
    timeline, started = Timeline(), time.perf_counter()
    # What decides the episodes (not how many run at once): a resumed evaluation must match them.
    progress = EvaluationProgress(
        out_dir,
        {
            "policy": policy,
            "mode": mode,
            "n": n,
            "temperature": temperature,
            "max_turns": max_turns,
            "max_new_tokens": max_new_tokens,
            "max_context": max_context,
            "engine": engine,
            "dtype": dtype,
            "prompt": dataclasses.asdict(prompt),
        },
        list(by_id),
        n,
    )
    remaining = [t for t in tasks if t.instance_id not in progress.complete]
    try:
        episodes = progress.kept + (
            _episodes(
                policy,
                remaining,
                mode=mode,
                timeline=timeline,
                n=n,
                max_turns=max_turns,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                num_envs=num_envs,
                engine=engine,
                prompt=prompt,
                ray=ray,
                max_context=max_context,
                engine_options=engine_options,
                dtype=dtype,
                on_episode=progress.save,
            )
            if remaining
            else []
        )
    finally:
        progress.close()
    if mode == "single":
        _judge(episodes, by_id, kind, timeline, ray=ray)
    else:
        for e in episodes:
            e.pred_sqls = submitted(e.messages)
    order = {t.instance_id: i for i, t in enumerate(tasks)}
    episodes.sort(key=lambda e: (order[e.task_id], e.group))
    try:
        TrajectoryStore(store_dir or out_dir).append(
            (
                row
                for e in episodes
                for row in episode_rows(
                    e, category=by_id[e.task_id].category, run=label, stage="eval", mode=mode
                )
            ),
            name=f"eval-{progress.id}",
        )
        _write_files(out_dir, episodes, by_id, kind)
    except OSError as exc:
        raise OutputWriteError(
            f"cannot write the evaluation's results into {out_dir} ({exc}); its episodes are kept "
            f"in {progress.path}: make room and run the same command to finish"
        ) from exc
    seconds = time.perf_counter() - started
    split = {f"{k}_s": round(v, 2) for k, v in timeline.split(started, started + seconds).items()}
    summary = _summarize(episodes, by_id, n)
    summary["outcomes"] = _outcomes(episodes, by_id, mode)
    metric = kind.metric
    summary.update(metric=metric, task=kind.skill, suite=suite, policy=policy, label=label)
    summary.update(mode=mode, split=task_set, seconds=round(seconds, 2), time_split=split)
    summary["prompt"] = dataclasses.asdict(prompt)
    summary["dtype"] = dtype
    # An evaluation resumed after an interruption: the tasks it kept, and the seconds spent on
    # them before (``seconds`` and ``time_split`` are this run's own).
    summary["resumed_tasks"] = len(progress.complete)
    summary["earlier_seconds"] = round(progress.earlier_seconds, 2)
    # The figures under the kind's own names too (execution_accuracy, by_difficulty for BIRD).
    summary[kind.metric_name] = summary["success_rate"]
    summary[f"by_{kind.category_name}"] = summary["by_category"]
    summary["table"] = _table(label, summary, suite)
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

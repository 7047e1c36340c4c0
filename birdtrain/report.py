"""``birdtrain report RUN_DIR``: a self-contained HTML report of a run, with PNG plots.

Built only from the run directory: each stage's ``metrics.jsonl``, the evaluation summaries under
``eval/`` and the trajectory store. Evaluations of one policy on both task kinds are shown side by
side: Success Rate on debugging tasks and execution accuracy on BIRD questions, one row per
evaluation label (``before``, ``after_stage2``, ``after_stage4``, ...). Plots are written as PNG files beside ``report.html`` and
embedded in it, so the page is one file that opens anywhere.
"""

from __future__ import annotations

import base64
import html
import itertools
import json
from pathlib import Path
from typing import Any

from birdenv.files import LOCK_FILE, exclusive_lock
from birdtrain import require
from birdtrain.config import STAGES
from birdtrain.sampling import read_groups
from birdtrain.stats import reward_trend, reward_trend_within_tasks, wilson_interval
from birdtrain.trajectory_store import TrajectoryStore

#: The stages whose reward the report follows step by step (the GRPO stages).
RL_STAGES = ("stage3", "stage4")

__all__ = [
    "evaluation_changes_table",
    "evaluations_table",
    "metrics_side_by_side",
    "reward_trend_table",
    "reward_trend_within_tasks_table",
    "write_report",
]

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1100px; color: #222; }
h1 { margin-bottom: 0.2rem; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; margin-top: 2rem; }
.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 1rem; }
img { width: 100%; border: 1px solid #eee; }
table { border-collapse: collapse; width: 100%; font-size: 0.9rem; }
td, th { border: 1px solid #ddd; padding: 0.3rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } code { font-size: 0.85rem; white-space: pre-wrap; }
.muted { color: #777; } .note { border: 1px dashed #bbb; padding: 1rem; color: #555; }
"""


def _metrics(run_dir: Path, stage: str) -> list[dict[str, Any]]:
    path = run_dir / stage / "metrics.jsonl"
    if not (run_dir / stage / "DONE").is_file() or not path.is_file():
        return []  # a stage under way (or never run): the report shows what is complete
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(rows: list[dict[str, Any]], *keys: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the first key present in the rows."""
    for key in keys:
        points = [
            (r.get("step", i), r[key])
            for i, r in enumerate(rows)
            if isinstance(r.get(key), (int, float))
        ]
        if points:
            return [p[0] for p in points], [p[1] for p in points]
    return [], []


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (fewer at the start).

    >>> _moving_average([0.0, 1.0, 1.0, 0.0], 2)
    [0.0, 0.5, 1.0, 0.5]
    """
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
        for i in range(len(values))
    ]


def _zeros_in_words(title: str, values: list[float], names: list[str], unit: str) -> str | None:
    """A sentence in place of a chart whose every value is 0, else None.

    An empty-looking axis around zero reads as a rendering fault, and "nothing was learnt" (or
    "nothing passed") should be said in words.

    >>> _zeros_in_words("SR by category", [0.0, 0.0], ["before"], "bars")
    'SR by category: every value is 0 (2 bars of before).'
    >>> _zeros_in_words("SR by category", [0.0, 12.5], ["before"], "bars") is None
    True
    """
    if values and all(v == 0 for v in values):
        return f"{title}: every value is 0 ({len(values)} {unit} of {', '.join(names)})."
    return None


def _lines(
    path: Path,
    title: str,
    series: list[tuple[str, list[float], list[float]]],
    xlabel: str = "step",
    *,
    smooth: bool = False,
) -> Path | str | None:
    """A line chart of ``series``; ``smooth`` adds each one's moving average.

    Returns the PNG, or a sentence instead when every value is 0 (an empty-looking axis around
    zero reads as a rendering fault, and "nothing was learnt" should be said in words), or None
    without data.
    """
    values = [y for _, _, ys in series for y in ys]
    if not values:
        return None
    zeros = _zeros_in_words(title, values, [label for label, xs, _ in series if xs], "points")
    if zeros:
        return zeros

    def draw(ax) -> bool:
        for label, xs, ys in series:
            if not xs:
                continue
            line = ax.plot(
                xs, ys, marker="o", markersize=3, alpha=0.5 if smooth else 1, label=label
            )
            if smooth:
                window = max(2, len(ys) // 5)
                ax.plot(
                    xs,
                    _moving_average(ys, window),
                    color=line[0].get_color(),
                    label=f"{label} ({window}-step mean)",
                )
        ax.set_xlabel(xlabel)
        ax.legend(fontsize=8)
        return True

    return _figure(path, title, draw)


def _figure(path: Path, title: str, draw) -> Path | None:
    require("matplotlib").use("Agg")  # before pyplot: no display is needed or wanted
    # the train extra: imported only where used
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=100)
    drawn = draw(ax)
    if not drawn:
        plt.close(fig)
        return None
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _eval_summaries(run_dir: Path) -> dict[str, dict[str, Any]]:
    summaries = {}
    for path in sorted((run_dir / "eval").glob("*/summary.json")):
        summaries[path.parent.name] = json.loads(path.read_text())
    return summaries


def metrics_side_by_side(summaries: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """One row per evaluation label: ``[label, SR %, tasks, EX %, questions]`` ("" when absent).

    A summary counts as execution accuracy when its ``metric`` is ``"EX"`` (BIRD questions), else
    as Success Rate; its label is its own ``label`` (the folder name for older summaries), so
    ``eval/before/`` and ``eval/before-bird/`` share the row ``before``. Only agent-mode
    evaluations on held-out tasks count here; :func:`evaluations_table` lists every evaluation.
    """
    rows: dict[str, list[Any]] = {}
    for folder, summary in summaries.items():
        if summary.get("mode", "agent") != "agent" or summary.get("split") == "train":
            continue  # the side-by-side is the paper's metric: agents on held-out tasks
        label = str(summary.get("label") or folder)
        row = rows.setdefault(label, [label, "", "", "", ""])
        rate = f"{summary.get('success_rate', 0):.2f}"
        where = f"{summary.get('n')} ({summary.get('suite', '')})".replace(" ()", "")
        if summary.get("metric") == "EX":
            row[3], row[4] = rate, where
        else:
            row[1], row[2] = rate, where
    return sorted(rows.values(), key=lambda r: (_eval_rank(r[0]), r[0]))


def evaluations_table(summaries: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """One row per evaluation: label, mode, tasks (training or held out), metric, the rate with
    its 95 % Wilson interval, tasks, pass@k, how the episodes ended.

    >>> evaluations_table({"before": {"label": "before", "mode": "agent", "metric": "SR",
    ...                    "success_rate": 12.5, "n": 24, "samples": 1}})
    [['before', 'agent', 'held out', 'SR', '12.5 [4.3, 31.0]', 24, '', '']]
    """
    # Where evaluations are compared only: birdtrain.evaluate brings gymnasium and the data
    # builders (1.3 s of CPU, against 0.19 s for `birdtrain report`'s own imports; measured).
    from birdtrain.evaluate import describe_outcomes

    rows = []
    for folder, s in summaries.items():
        n = int(s.get("n") or 0)
        lo, hi = wilson_interval(round(s.get("success_rate", 0.0) * n / 100), n)
        k = s.get("samples", 1)
        rows.append(
            [
                str(s.get("label") or folder),
                s.get("mode", "agent"),
                _task_set(s),
                s.get("metric", "SR"),
                f"{s.get('success_rate', 0.0):.1f} [{100 * lo:.1f}, {100 * hi:.1f}]",
                n,
                f"pass@{k} {s[f'pass@{k}']:.1f}" if k > 1 and f"pass@{k}" in s else "",
                describe_outcomes(s["outcomes"]) if "outcomes" in s else "",
            ]
        )
    return sorted(rows, key=lambda r: (_eval_rank(r[0]), r[0], r[2], r[1], r[3]))


def _task_set(summary: dict[str, Any]) -> str:
    """Which tasks an evaluation ran on, in words: its own training tasks or held-out ones."""
    return "training" if summary.get("split") == "train" else "held out"


def _eval_rank(label: str) -> int:
    """Where an evaluation label comes in a curriculum: ``before``, then ``after_stageN`` by N,
    then any other label."""
    if label == "before":
        return 0
    stage = label.removeprefix("after_stage")
    return int(stage) if stage.isdigit() else 9


def evaluation_changes_table(
    run_dir: Path, summaries: dict[str, dict[str, Any]]
) -> list[list[Any]]:
    """Each evaluation against the one before it on the same tasks in the same mode, paired task
    by task (:func:`birdtrain.evaluate.compare_evaluations`): the tasks and mode, the two labels,
    their rates, the difference in points with its 95 % interval, the tasks that rose and fell,
    and whether it changed beyond the noise. Evaluations of one series share their folder's suffix
    after the label (``-train``, ``-single``, ``-bird``, ...); those without ``verdicts.jsonl``
    are left out."""
    from birdtrain.evaluate import compare_evaluations  # see evaluations_table

    series: dict[tuple[str, str, str], list[tuple[int, str, str]]] = {}
    for folder, s in summaries.items():
        if not (run_dir / "eval" / folder / "verdicts.jsonl").is_file():
            continue
        label = str(s.get("label") or folder)
        key = (
            folder.removeprefix(label),
            f"{s.get('mode', 'agent')}, {_task_set(s)}",
            s.get("metric", "SR"),
        )
        series.setdefault(key, []).append((_eval_rank(label), label, folder))
    rows = []
    for (_, where, metric), evaluations in sorted(series.items()):
        evaluations.sort()
        for (_, before, a), (_, after, b) in itertools.pairwise(evaluations):
            change = compare_evaluations(run_dir / "eval" / a, run_dir / "eval" / b)
            rows.append(
                [
                    f"{where} ({metric})",
                    f"{before} → {after}",
                    f"{100 * change['a']:.1f} → {100 * change['b']:.1f}",
                    *_difference(change, percent=True),
                    f"{change['improved']} / {change['worsened']} of {change['tasks']}",
                ]
            )
    return rows


def reward_trend_table(metrics: dict[str, list[dict[str, Any]]]) -> list[list[Any]]:
    """One row per RL stage with logged steps: the first-round reward of its first and last
    thirds of steps, their difference with a 95 % interval, and whether it rose beyond the noise
    (:func:`birdtrain.stats.reward_trend`)."""

    rows = []
    for stage in RL_STAGES:
        steps = [
            (m["sampling/reward_before"], m["sampling/reward_before_sq"], int(m["sampling/groups"]))
            for m in metrics.get(stage, [])
            if "sampling/reward_before" in m
        ]
        trend = reward_trend(steps)
        if trend is None:
            continue
        rows.append(
            [
                stage,
                len(steps),
                f"{trend['first']:.3f}",
                f"{trend['last']:.3f}",
                *_difference(trend),
            ]
        )
    return rows


def reward_trend_within_tasks_table(
    groups: dict[str, list[tuple[int, str, float]]],
) -> list[list[Any]]:
    """One row per RL stage with recorded groups (its ``groups.jsonl``): the trend compared task
    by task (:func:`birdtrain.stats.reward_trend_within_tasks`), so that which tasks each third
    happened to draw does not count as a change."""

    rows = []
    for stage in RL_STAGES:
        trend = reward_trend_within_tasks(groups.get(stage, []))
        if trend is None:
            continue
        n_first, n_last = trend["groups"]
        rows.append(
            [
                stage,
                len({s for s, _, _ in groups[stage]}),
                trend["tasks"],
                f"{n_first} / {n_last}",
                *_difference(trend),
            ]
        )
    return rows


def _difference(trend: dict[str, Any], *, percent: bool = False) -> list[str]:
    """A difference with its interval (in points with ``percent``), and whether it rose or fell
    beyond the noise."""
    low, high = trend["ci95"]
    verdict = "rose" if low > 0 else "fell" if high < 0 else "within noise"
    scale, digits = (100, 1) if percent else (1, 3)
    d, low, high = (scale * x for x in (trend["difference"], low, high))
    return [f"{d:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]", verdict]


def _img(path: Path | str | None) -> str:
    if path is None:
        return ""
    if isinstance(path, str):
        return f'<p class="note">{html.escape(path)}</p>'
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td><code>{html.escape(str(c))}</code></td>" for c in row) + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>" if rows else '<p class="muted">no data yet</p>'


def write_report(run_dir: str | Path) -> Path:
    """Write ``{run_dir}/report/report.html`` (and its PNGs) and return its path.

    It reads what is complete (finished stages and evaluations), so it runs beside a curriculum
    that writes the directory; two reports of one run take turns (a lock on ``report/``)."""
    run_dir = Path(run_dir)
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(out / LOCK_FILE):
        return _write_report(run_dir, out)


def _write_report(run_dir: Path, out: Path) -> Path:
    """The page, section by section: the evaluations, the training, the trajectories."""
    store = TrajectoryStore(run_dir)
    config = run_dir / "config.json"
    commit = json.loads(config.read_text()).get("git_commit") if config.is_file() else None
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>bird-rl report: {
        html.escape(run_dir.name)
    }</title>
<style>{_CSS}</style></head><body>
<h1>bird-rl run <code>{html.escape(run_dir.name)}</code></h1>
<p class="muted">{html.escape(str(run_dir.resolve()))}{
        f" · commit {html.escape(commit[:10])}" if commit else ""
    }</p>
{_evaluations_section(run_dir, out)}
{_training_section(run_dir, out)}
{_trajectories_section(store, out)}
</body></html>"""
    report = out / "report.html"
    report.write_text(page, encoding="utf-8")
    return report


def _evaluations_section(run_dir: Path, out: Path) -> str:
    """Each evaluation's rates side by side, by category, with intervals, and their changes."""
    summaries = _eval_summaries(run_dir)
    categories = sorted({c for s in summaries.values() for c in s.get("by_category", {})})
    rates = {
        label: [
            summary.get("by_category", {}).get(c, {}).get("success_rate", 0.0) for c in categories
        ]
        for label, summary in summaries.items()
    }

    def category_plot(ax) -> bool:
        if not categories:
            return False
        width = 0.8 / len(rates)
        for i, (label, values) in enumerate(rates.items()):
            ax.bar([x + i * width for x in range(len(categories))], values, width, label=label)
        ax.set_xticks(
            [x + width * (len(summaries) - 1) / 2 for x in range(len(categories))], categories
        )
        ax.set_ylabel("SR % / EX %")
        ax.legend(fontsize=8)
        return True

    title = "SR by category, EX by difficulty"
    by_category = _zeros_in_words(
        title, [v for values in rates.values() for v in values], list(rates), "bars"
    ) or _figure(out / "success_by_category.png", title, category_plot)
    sr_rows = metrics_side_by_side(summaries)
    return f"""<h2>Success Rate (debugging) and execution accuracy (generation)</h2>{
        _table(["evaluation", "SR %", "debugging tasks", "EX %", "BIRD questions"], sr_rows)
    }
<div class="grid">{_img(by_category)}</div>
<h2>Every evaluation, with 95 % intervals</h2>{
        _table(
            [
                "evaluation",
                "mode",
                "tasks",
                "metric",
                "rate % [95 % CI]",
                "n",
                "pass@k",
                "outcomes",
            ],
            evaluations_table(summaries),
        )
    }
<p>What changed from one evaluation to the next on the same tasks: each task against itself; the
interval is a paired t interval over the tasks.</p>{
        _table(
            [
                "tasks",
                "evaluations",
                "rate %",
                "difference, points [95 % CI]",
                "change",
                "tasks rose / fell",
            ],
            evaluation_changes_table(run_dir, summaries),
        )
    }"""


def _training_section(run_dir: Path, out: Path) -> str:
    """Each stage's loss and learning rate, the RL stages' reward, pass rate and zero-variance
    groups per step, and whether their reward rose."""
    metrics = {stage: _metrics(run_dir, stage) for stage in STAGES}
    groups = {
        stage: read_groups(run_dir / stage / "groups.jsonl") if metrics[stage] else []
        for stage in RL_STAGES
    }
    figures = [
        _lines(
            out / "loss.png",
            "training loss per stage",
            [(s, *_series(metrics[s], "loss")) for s in STAGES],
        ),
        _lines(
            out / "learning_rate.png",
            "learning rate per stage",
            [(s, *_series(metrics[s], "learning_rate")) for s in STAGES],
        ),
        _lines(
            out / "reward.png",
            "reward per step (stages 3-4)",
            [(f"{s} reward", *_series(metrics[s], "reward_mean", "reward")) for s in RL_STAGES],
            smooth=True,
        ),
        _lines(
            out / "pass_rate.png",
            "pass rate per step (stages 3-4)",
            [(f"{s} pass rate", *_series(metrics[s], "pass_rate")) for s in RL_STAGES],
            smooth=True,
        ),
        _lines(
            out / "zero_std.png",
            "groups with zero reward variance (no advantage), per step",
            [
                (f"{s} {when}", *_series(metrics[s], key))
                for s in RL_STAGES
                for when, key in (
                    ("sampled", "sampling/frac_reward_zero_std_before"),
                    ("trained on", "frac_reward_zero_std"),
                )
            ],
        ),
    ]
    return f"""<h2>Training</h2><div class="grid">{"".join(_img(f) for f in figures)}</div>
<p>Reward of each step's own draw of tasks (before dynamic sampling drops groups), last third of
the steps against the first; the interval is over task groups.</p>{
        _table(
            ["stage", "steps", "first third", "last third", "difference [95 % CI]", "trend"],
            reward_trend_table(metrics),
        )
    }
<p>The same compared task by task (each step's draw as recorded in the stage's
<code>groups.jsonl</code>): each task drawn in both thirds against itself, weighted by its groups;
the interval is over the groups' spread around their task's mean.</p>{
        _table(
            [
                "stage",
                "steps",
                "tasks in both thirds",
                "groups first / last",
                "difference [95 % CI]",
                "trend",
            ],
            reward_trend_within_tasks_table(groups),
        )
    }"""


def _trajectories_section(store: TrajectoryStore, out: Path) -> str:
    """Tool calls and turns per episode, the slowest statements and the commonest errors."""
    per_episode = store.query(
        "SELECT episode, count(*) AS turns, count(tool) AS calls, count(*) - count(tool) AS invalid "
        "FROM trajectories WHERE mode IS DISTINCT FROM 'single' GROUP BY episode"
    )

    def tools_plot(ax) -> bool:
        if not per_episode:
            return False
        calls = [r[2] for r in per_episode]
        invalid = [r[3] / r[1] for r in per_episode]
        ax.hist([calls, invalid], bins=10, label=["tool calls per trajectory", "invalid-call rate"])
        ax.legend(fontsize=8)
        return True

    def turns_plot(ax) -> bool:
        if not per_episode:
            return False
        ax.hist(
            [r[1] for r in per_episode],
            bins=range(1, max(r[1] for r in per_episode) + 2),
            align="left",
        )
        ax.set_xlabel("assistant turns")
        return True

    tools = _figure(
        out / "tool_calls.png", "tool calls and invalid calls per trajectory", tools_plot
    )
    turns = _figure(out / "turns.png", "turns per episode", turns_plot)
    slowest = store.query(
        "SELECT round(env_seconds, 3), task_id, sql FROM trajectories "
        "WHERE tool = 'execute_sql' AND env_seconds IS NOT NULL ORDER BY env_seconds DESC LIMIT 10"
    )
    errors = store.query(
        "SELECT error, count(*) AS n FROM trajectories WHERE error IS NOT NULL "
        "AND observation LIKE 'status: error%' AND tool IS NOT NULL GROUP BY error ORDER BY n DESC LIMIT 10"
    )
    return f"""<h2>Trajectories</h2><div class="grid">{_img(tools)}{_img(turns)}</div>
<h2>Slowest SQL statements</h2>{_table(["seconds", "task", "sql"], [list(r) for r in slowest])}
<h2>Most common SQLite errors</h2>{_table(["error", "count"], [list(r) for r in errors])}"""

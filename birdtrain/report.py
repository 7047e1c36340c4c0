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
import json
from pathlib import Path
from typing import Any

from birdtrain import require
from birdtrain.config import STAGES
from birdtrain.trajectory_store import TrajectoryStore

__all__ = ["metrics_side_by_side", "write_report"]

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1100px; color: #222; }
h1 { margin-bottom: 0.2rem; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; margin-top: 2rem; }
.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 1rem; }
img { width: 100%; border: 1px solid #eee; }
table { border-collapse: collapse; width: 100%; font-size: 0.9rem; }
td, th { border: 1px solid #ddd; padding: 0.3rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } code { font-size: 0.85rem; white-space: pre-wrap; }
.muted { color: #777; }
"""


def _metrics(run_dir: Path, stage: str) -> list[dict[str, Any]]:
    path = run_dir / stage / "metrics.jsonl"
    if not path.is_file():
        return []
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


def _figure(path: Path, title: str, draw) -> Path | None:
    require("matplotlib").use("Agg")  # before pyplot: no display is needed or wanted
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


def _plot_lines(ax, series: list[tuple[str, list[float], list[float]]], xlabel: str) -> bool:
    drawn = False
    for label, xs, ys in series:
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
            drawn = True
    if drawn:
        ax.set_xlabel(xlabel)
        ax.legend(fontsize=8)
    return drawn


def _eval_summaries(run_dir: Path) -> dict[str, dict[str, Any]]:
    summaries = {}
    for path in sorted((run_dir / "eval").glob("*/summary.json")):
        summaries[path.parent.name] = json.loads(path.read_text())
    return summaries


def metrics_side_by_side(summaries: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """One row per evaluation label: ``[label, SR %, tasks, EX %, questions]`` ("" when absent).

    A summary counts as execution accuracy when its ``metric`` is ``"EX"`` (BIRD questions), else
    as Success Rate; its label is its own ``label`` (the folder name for older summaries), so
    ``eval/before/`` and ``eval/before-bird/`` share the row ``before``.
    """
    rows: dict[str, list[Any]] = {}
    for folder, summary in summaries.items():
        label = str(summary.get("label") or folder)
        row = rows.setdefault(label, [label, "", "", "", ""])
        rate = f"{summary.get('success_rate', 0):.2f}"
        where = f"{summary.get('n')} ({summary.get('suite', '')})".replace(" ()", "")
        if summary.get("metric") == "EX":
            row[3], row[4] = rate, where
        else:
            row[1], row[2] = rate, where
    order = {"before": 0, "after_stage2": 1, "after_stage4": 2}
    return sorted(rows.values(), key=lambda r: (order.get(r[0], 3), r[0]))


def _img(path: Path | None) -> str:
    if path is None:
        return ""
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
    """Write ``{run_dir}/report/report.html`` (and its PNGs) and return its path."""
    run_dir = Path(run_dir)
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    metrics = {stage: _metrics(run_dir, stage) for stage in STAGES}
    store = TrajectoryStore(run_dir)
    figures: dict[str, Path | None] = {}

    figures["loss"] = _figure(
        out / "loss.png",
        "training loss per stage",
        lambda ax: _plot_lines(ax, [(s, *_series(metrics[s], "loss")) for s in STAGES], "step"),
    )
    figures["lr"] = _figure(
        out / "learning_rate.png",
        "learning rate per stage",
        lambda ax: _plot_lines(
            ax, [(s, *_series(metrics[s], "learning_rate")) for s in STAGES], "step"
        ),
    )
    figures["reward"] = _figure(
        out / "reward.png",
        "reward mean and pass rate (stages 3-4)",
        lambda ax: _plot_lines(
            ax,
            [
                (f"{s} reward", *_series(metrics[s], "reward_mean", "reward"))
                for s in ("stage3", "stage4")
            ]
            + [(f"{s} pass rate", *_series(metrics[s], "pass_rate")) for s in ("stage3", "stage4")],
            "step",
        ),
    )
    per_episode = store.query(
        "SELECT episode, count(*) AS turns, count(tool) AS calls, count(*) - count(tool) AS invalid "
        "FROM trajectories GROUP BY episode"
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

    figures["tools"] = _figure(
        out / "tool_calls.png", "tool calls and invalid calls per trajectory", tools_plot
    )
    figures["turns"] = _figure(out / "turns.png", "turns per episode", turns_plot)
    summaries = _eval_summaries(run_dir)

    def category_plot(ax) -> bool:
        if not summaries:
            return False
        categories = sorted({c for s in summaries.values() for c in s.get("by_category", {})})
        width = 0.8 / len(summaries)
        for i, (label, summary) in enumerate(summaries.items()):
            values = [
                summary.get("by_category", {}).get(c, {}).get("success_rate", 0.0)
                for c in categories
            ]
            ax.bar([x + i * width for x in range(len(categories))], values, width, label=label)
        ax.set_xticks(
            [x + width * (len(summaries) - 1) / 2 for x in range(len(categories))], categories
        )
        ax.set_ylabel("SR % / EX %")
        ax.legend(fontsize=8)
        return True

    figures["categories"] = _figure(
        out / "success_by_category.png", "SR by category, EX by difficulty", category_plot
    )
    slowest = store.query(
        "SELECT round(env_seconds, 3), task_id, sql FROM trajectories "
        "WHERE tool = 'execute_sql' AND env_seconds IS NOT NULL ORDER BY env_seconds DESC LIMIT 10"
    )
    errors = store.query(
        "SELECT error, count(*) AS n FROM trajectories WHERE error IS NOT NULL "
        "AND observation LIKE 'status: error%' AND tool IS NOT NULL GROUP BY error ORDER BY n DESC LIMIT 10"
    )
    config = run_dir / "config.json"
    commit = json.loads(config.read_text()).get("git_commit") if config.is_file() else None
    sr_rows = metrics_side_by_side(summaries)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>bird-rl report: {
        html.escape(run_dir.name)
    }</title>
<style>{_CSS}</style></head><body>
<h1>bird-rl run <code>{html.escape(run_dir.name)}</code></h1>
<p class="muted">{html.escape(str(run_dir.resolve()))}{
        f" · commit {html.escape(commit[:10])}" if commit else ""
    }</p>
<h2>Success Rate (debugging) and execution accuracy (generation)</h2>{
        _table(["evaluation", "SR %", "debugging tasks", "EX %", "BIRD questions"], sr_rows)
    }
<div class="grid">{_img(figures["categories"])}</div>
<h2>Training</h2><div class="grid">{_img(figures["loss"])}{_img(figures["lr"])}{
        _img(figures["reward"])
    }</div>
<h2>Trajectories</h2><div class="grid">{_img(figures["tools"])}{_img(figures["turns"])}</div>
<h2>Slowest SQL statements</h2>{_table(["seconds", "task", "sql"], [list(r) for r in slowest])}
<h2>Most common SQLite errors</h2>{_table(["error", "count"], [list(r) for r in errors])}
</body></html>"""
    report = out / "report.html"
    report.write_text(page, encoding="utf-8")
    return report

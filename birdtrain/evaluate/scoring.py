"""Judging and summaries: single-mode answers judged, success rates with intervals, pass@k, how
the episodes ended, and the table beside the paper's figures."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from birdenv.judge import score_many
from birdenv.tasks import Task, task_kinds
from birdenv.tools import has_tool_call
from birdtrain.data.kinds import training_kind
from birdtrain.rollout import Episode
from birdtrain.stats import pass_at_k, wilson_interval
from birdtrain.timeline import Timeline

__all__ = [
    "PAPER_BIRD_RESULTS",
    "PAPER_RESULTS",
    "describe_outcomes",
    "judge_answers",
    "outcomes",
    "paper_table",
    "summarize",
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


def judge_answers(
    episodes: list[Episode],
    by_id: dict[str, Task],
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


def _rate(passed: float, n: int) -> dict[str, Any]:
    """A success rate in percent with its 95 % Wilson interval."""
    low, high = wilson_interval(passed, n)
    return {"n": n, "success_rate": 100 * passed / n, "ci95": [100 * low, 100 * high]}


def summarize(episodes: list[Episode], by_id: dict[str, Task], n: int) -> dict[str, Any]:
    """The success rate of the tasks' first samples with its 95 % interval, the same by category
    (or difficulty), and pass@1 and pass@n over every sample when ``n > 1``."""
    by_task: dict[str, list[bool]] = defaultdict(list)
    for e in episodes:
        by_task[e.task_id].append(e.passed)
    category = {t: by_id[t].category for t in by_task}
    first = {t: results[0] for t, results in by_task.items()}
    known = [c for kind in task_kinds() for c in kind.categories]  # each kind's report order
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


def outcomes(episodes: list[Episode], by_id: dict[str, Task], mode: str) -> dict[str, int]:
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
    unchanged = {training_kind(by_id[e.task_id].kind).unchanged for e in episodes}
    if len(unchanged) == 1 and None not in unchanged:  # one kind, which has such an answer
        (nothing,) = unchanged
        counts["unchanged"] = sum(
            words(e.pred_sqls) == words(nothing(by_id[e.task_id])) for e in answered
        )
    if mode == "agent":
        turns = [m["content"] for e in episodes for m in e.messages if m["role"] == "assistant"]
        counts["turns"] = len(turns)
        counts["unparsed_turns"] = sum(not has_tool_call(text) for text in turns)
    return counts


def describe_outcomes(outcomes: dict[str, int]) -> str:
    """One line for :func:`outcomes`' counts.

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


def paper_table(label: str, summary: dict[str, Any], suite: str) -> str:
    """The summary's figure among the paper's, best first, then its categories and pass@k."""
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

"""The report shows learning: reward and zero-variance plots per step, intervals, zeros in words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the report is in the train extra")

from birdenv import load_tasks
from birdtrain.evaluate import evaluate_policy
from birdtrain.report import (
    evaluation_changes_table,
    reward_trend_table,
    reward_trend_within_tasks_table,
    write_report,
)
from birdtrain.sampling import SamplingStats, read_groups, record_groups
from birdtrain.stats import reward_trend_within_tasks


def _steps(rewards: list[float], spread: float = 0.01) -> list[dict[str, float]]:
    """Dynamic sampling's first-round figures: 4 groups a step around each mean reward."""
    return [
        {
            "sampling/reward_before": r,
            "sampling/reward_before_sq": r * r + spread,
            "sampling/groups": 4.0,
        }
        for r in rewards
    ]


def _run(tmp_path: Path, rewards: list[float]) -> Path:
    run = tmp_path / "run"
    (run / "stage4").mkdir(parents=True)
    rows = [
        {
            "step": i + 1,
            "loss": 0.1 * (i + 1),
            "reward": r,
            "agentic/reward_mean": r,
            "reward_mean": r,
            "pass_rate": r,
            "frac_reward_zero_std": 0.25,
            "sampling/frac_reward_zero_std_before": 0.75,
            **first_round,
        }
        for (i, r), first_round in zip(enumerate(rewards), _steps(rewards), strict=True)
    ]
    (run / "stage4" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "stage4" / "DONE").write_text("{}")  # the report shows complete stages
    for label, split, rate in (("before", "heldout", 0.0), ("after_stage4", "train", 12.5)):
        folder = run / "eval" / (label if split == "heldout" else f"{label}-train")
        folder.mkdir(parents=True)
        summary = {"label": label, "split": split, "mode": "agent", "metric": "SR"}
        summary |= {"success_rate": rate, "n": 24, "samples": 1, "by_category": {}}
        (folder / "summary.json").write_text(json.dumps(summary))
    return run


def test_learning_curves_and_intervals(tmp_path: Path) -> None:
    run = _run(tmp_path, [0.0, 0.25, 0.25, 0.5, 0.5, 0.75])
    html = write_report(run).read_text()
    for name in ("reward", "pass_rate", "zero_std"):
        assert (run / "report" / f"{name}.png").stat().st_size > 5_000
    # The training-task evaluation and its interval; a held-out one at 0 still has an interval.
    assert "<code>training</code>" in html and "<code>12.5 [4.3, 31.0]</code>" in html
    assert "<code>0.0 [0.0, 13.8]</code>" in html
    # Steps 1-2 against 5-6: 0.125 -> 0.625, over 8 groups each with a spread of 0.1 a step.
    assert "<code>+0.500 [+0.332, +0.668]</code></td><td><code>rose</code>" in html


@pytest.mark.parametrize(
    ("rewards", "spread", "trend"),
    [
        ([0.0, 0.25, 0.25, 0.5, 0.5, 0.75], 0.01, "rose"),
        ([0.75, 0.5, 0.5, 0.25, 0.25, 0.0], 0.01, "fell"),
        # The same rise, but groups of one step differ by +-0.5: no longer beyond the noise.
        ([0.0, 0.25, 0.25, 0.5, 0.5, 0.75], 0.25, "within noise"),
    ],
)
def test_a_reward_trend_is_judged_against_the_spread_between_groups(
    rewards: list[float], spread: float, trend: str
) -> None:
    (row,) = reward_trend_table({"stage3": _steps(rewards, spread), "stage4": []})
    assert row[0] == "stage3" and row[1] == 6 and row[-1] == trend


def test_an_all_zero_chart_is_said_in_words(tmp_path: Path) -> None:
    run = _run(tmp_path, [0.0] * 4)
    html = write_report(run).read_text()
    assert not (run / "report" / "reward.png").exists()
    assert "reward per step (stages 3-4): every value is 0 (4 points of stage4 reward)." in html


def test_a_trend_compared_task_by_task_sees_through_the_draw(tmp_path: Path) -> None:
    """Both tasks' rewards rise by 0.2, but the first third drew mostly the easy task and the last
    mostly the hard one: the thirds' plain means fall (0.45 to 0.35), the task-by-task comparison
    rises beyond its noise."""
    run = _run(tmp_path, [0.5] * 6)
    wobble = [0.02, -0.02, 0.0]
    for step in range(1, 7):
        late = step > 3
        tasks = ["easy"] * 3 + ["hard"] if not late else ["hard"] * 3 + ["easy"]
        means = {"easy": 0.8 if late else 0.6, "hard": 0.2 if late else 0.0}
        draw = [(t, means[t] + wobble[(step + i) % 3]) for i, t in enumerate(tasks)]
        record_groups(
            run / "stage4" / "groups.jsonl",
            step,
            SamplingStats(4, 0, 0, 0, 16, 0, first_round=draw),
        )
    (row,) = reward_trend_within_tasks_table(
        {"stage4": read_groups(run / "stage4" / "groups.jsonl")}
    )
    assert row[:4] == ["stage4", 6, 2, "8 / 8"] and row[-1] == "rose"
    assert row[4].startswith("+0.2")
    trend = reward_trend_within_tasks(read_groups(run / "stage4" / "groups.jsonl"))
    assert trend is not None and trend["last"] < trend["first"]
    html = write_report(run).read_text()
    assert f"<code>{row[4]}</code></td><td><code>rose</code>" in html


def test_each_evaluation_is_compared_with_the_one_before_on_the_same_tasks(tmp_path: Path) -> None:
    """Real evaluations in a run directory, in curriculum order whatever their folders' names:
    echo (0 %) before, then the oracle twice (100 %); an evaluation without verdicts is left out."""
    run = _run(tmp_path, [0.5] * 3)  # its summaries have no verdicts: no row of their own
    tasks = load_tasks("critic-mini")[:5]
    for label, policy in (
        ("after_stage4", "oracle"),
        ("before", "echo"),
        ("after_stage2", "oracle"),
    ):
        evaluate_policy(policy, tasks=tasks, out_dir=run / "eval" / label, label=label, num_envs=2)
    summaries = {p.parent.name: json.loads(p.read_text()) for p in run.glob("eval/*/summary.json")}
    rows = evaluation_changes_table(run, summaries)
    assert rows == [
        [
            "agent, held out (SR)",
            "before → after_stage2",
            "0.0 → 100.0",
            "+100.0 [+100.0, +100.0]",
            "rose",
            "5 / 0 of 5",
        ],
        [
            "agent, held out (SR)",
            "after_stage2 → after_stage4",
            "100.0 → 100.0",
            "+0.0 [+0.0, +0.0]",
            "within noise",
            "0 / 0 of 5",
        ],
    ]
    html = write_report(run).read_text()
    assert "<code>before → after_stage2</code>" in html


def test_a_bar_chart_of_zeros_is_said_in_words(tmp_path: Path) -> None:
    """Every evaluation at 0 % in every category: a sentence, not an empty axis around zero."""
    run = _run(tmp_path, [0.5] * 3)
    by_category = {"Management": {"success_rate": 0.0}, "Query": {"success_rate": 0.0}}
    for path in run.glob("eval/*/summary.json"):
        path.write_text(json.dumps(json.loads(path.read_text()) | {"by_category": by_category}))
    html = write_report(run).read_text()
    assert not (run / "report" / "success_by_category.png").exists()
    assert "SR by category, EX by difficulty: every value is 0 (4 bars of " in html
    # One category above 0: the chart is drawn.
    by_category["Query"] = {"success_rate": 12.5}
    path.write_text(json.dumps(json.loads(path.read_text()) | {"by_category": by_category}))
    html = write_report(run).read_text()
    assert (run / "report" / "success_by_category.png").stat().st_size > 5_000
    assert "every value is 0 (4 bars" not in html

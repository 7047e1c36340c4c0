"""``birdtrain``: configuration, the smoke curriculum end to end, resuming, and the report."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the curriculum needs the train extra")

from birdenv.schema import PromptOptions
from birdtrain.cli import main
from birdtrain.config import PRESETS, load_config
from birdtrain.prompts import recorded_prompt
from birdtrain.sampling import read_groups

pytestmark = pytest.mark.long  # conftest.py: started first


def test_config_layers_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("name: mine\nstage3:\n  learning_rate: 2e-6\n  num_generations: 8\n")
    cfg = load_config("smoke", path, ["stage4.vector=sync", "stage3.beta=0.02"])
    assert (cfg.name, cfg.stage3.learning_rate, cfg.stage3.num_generations) == ("mine", 2e-6, 8)
    assert (cfg.stage4.vector, cfg.stage3.beta, cfg.model.name_or_path) == ("sync", 0.02, "tiny")
    paper = load_config("paper-7b")
    assert (paper.stage3.num_generations, paper.stage3.learning_rate, paper.stage4.max_turns) == (
        16,
        1e-6,
        5,
    )
    with pytest.raises(ValueError, match=r"valid keys: .*learning_rate"):
        load_config("smoke", overrides=["stage3.lr=1"])
    with pytest.raises(ValueError, match="unknown preset"):
        load_config("huge")
    with pytest.raises(ValueError, match="'async', 'sync' or 'ray', got 'threads'"):
        load_config("smoke", overrides=["stage4.vector=threads"])
    assert load_config("smoke", overrides=["stage4.vector=ray"]).stage4.vector == "ray"
    assert load_config("smoke").eval.after == ["stage2", "stage4"]
    assert load_config("smoke", overrides=["eval.after=stage3"]).eval.after == ["stage3"]
    with pytest.raises(ValueError, match=r"unknown stage 'stage5'; choose from stage1"):
        load_config("smoke", overrides=["eval.after=[stage2, stage5]"])


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_passes_the_configuration_checks_under_its_own_name(name: str) -> None:
    """A key the configuration lacks, or a value it refuses, in a shipped preset fails here,
    not when the run reaches that stage hours later."""
    assert load_config(name).name == name


def test_an_unknown_preset_is_one_line_naming_every_preset(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["curriculum", "--preset", "huge"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "'huge'" in error and all(f"'{name}'" in error for name in PRESETS)


def test_rl_settings_are_checked() -> None:
    """GRPO samples a group: temperature 0 would make TRL divide the logits by 0."""
    for stage in ("stage3", "stage4"):
        with pytest.raises(ValueError, match=rf"{stage}.temperature must be > 0"):
            load_config("smoke", overrides=[f"{stage}.temperature=0"])
        with pytest.raises(ValueError, match=rf"{stage}.difficulty_samples must be >= 2"):
            load_config("smoke", overrides=[f"{stage}.difficulty_samples=1"])
    with pytest.raises(ValueError, match="schema must be one of 'full', 'linked'"):
        load_config("smoke", overrides=["prompt.schema=short"])
    with pytest.raises(ValueError, match=r"eval\.modes must list 'agent' and/or 'single'"):
        load_config("smoke", overrides=["eval.modes=[agents]"])


def test_evaluations_follow_eval_before_and_after(tmp_path: Path, capsys) -> None:
    """Only the named evaluations run, each into eval/<label>/, and the report shows them."""
    stages_off = [f"stage{i}.enabled=false" for i in range(1, 5)]
    argv = ["curriculum", "--preset", "smoke", "--output-dir", str(tmp_path)]
    assert main([*argv, *stages_off, "eval.before=false", "eval.after=[stage1]"]) == 0
    run = tmp_path / "smoke"
    assert sorted(p.name for p in (run / "eval").iterdir()) == ["after_stage1"]
    summary = json.loads((run / "eval" / "after_stage1" / "summary.json").read_text())
    assert summary["label"] == "after_stage1" and summary["n"] == 4
    results = json.loads((run / "summary.json").read_text())
    assert results["before"] is None and results["after"] is None
    assert results["after_stage1"]["n"] == 4
    printed = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert any(words[:2] == ["after_stage1", "SR"] for words in printed)
    assert "<code>after_stage1</code>" in (run / "report" / "report.html").read_text()


def test_an_evaluation_after_a_stage_that_trained_nothing_is_reused(tmp_path: Path, capsys) -> None:
    """A disabled stage hands on the policy it was given: the evaluation after it is the one
    already made of that policy, not a second run of the same checkpoint."""
    stages_off = [f"stage{i}.enabled=false" for i in range(2, 5)]
    argv = ["curriculum", "--preset", "smoke", "--output-dir", str(tmp_path), *stages_off]
    # One step of stage 1 and two tasks to evaluate: what is reused does not depend on the sizes.
    argv += ["stage1.max_steps=1", "eval.max_tasks=2"]
    assert main([*argv, "eval.before=false", "eval.after=[stage1, stage2, stage4]"]) == 0
    run = tmp_path / "smoke"
    assert sorted(p.name for p in (run / "eval").iterdir()) == ["after_stage1"]
    results = json.loads((run / "summary.json").read_text())
    assert results["after_stage1"]["label"] == "after_stage1"
    assert results["after_stage2"] == results["after_stage1"] == results["after"]
    out = capsys.readouterr().out
    for stage in ("stage2", "stage4"):
        assert f"[eval after_{stage}] the policy of after_stage1: its evaluation reused" in out


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["curriculum", "--preset", "smoke", "--output-dir", str(out)]) == 0
    (out / "printed.txt").write_text(printed.getvalue())
    return out / "smoke"


def test_the_curriculum_prints_one_line_per_stage_and_evaluation(smoke_run: Path) -> None:
    """Quiet by default: no line per training step (metrics.jsonl has them), no library chatter."""
    lines = (smoke_run.parent / "printed.txt").read_text().splitlines()
    progress = [line.split("]")[0] + "]" for line in lines if line.startswith("[")]
    assert progress == [
        "[eval before]",
        "[stage1]",
        "[stage2]",
        "[eval after_stage2]",
        "[stage3]",
        "[stage4]",
        "[eval after_stage4]",
    ]
    summary = [line.split()[0] for line in lines if not line.startswith("[")]
    assert summary == ["before", "after_stage2", "after_stage4", "run"], lines


def test_smoke_curriculum_runs_all_four_stages(smoke_run: Path) -> None:
    record = json.loads((smoke_run / "config.json").read_text())
    assert record["config"]["model"]["name_or_path"] == "tiny"
    for stage in ("stage1", "stage2", "stage3", "stage4"):
        assert (smoke_run / stage / "DONE").is_file()
        assert (smoke_run / stage / "checkpoint" / "config.json").is_file()
        # Each checkpoint says which prompts it learned from, for evaluations to use the same.
        trained_on = PromptOptions.of(record["config"]["prompt"])
        assert recorded_prompt(smoke_run / stage / "checkpoint") == trained_on
        metrics = [
            json.loads(x) for x in (smoke_run / stage / "metrics.jsonl").read_text().splitlines()
        ]
        assert any("loss" in m for m in metrics), stage
    stage4 = [
        json.loads(x) for x in (smoke_run / "stage4" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [m for m in stage4 if "agentic/env_steps" in m]
    assert steps and all(m["agentic/env_steps"] > 0 for m in steps)
    assert all(
        {"agentic/reward_mean", "agentic/invalid_call_rate", "agentic/tool_calls_per_traj"}
        <= set(m)
        for m in steps
    )
    # Stage 2 taught the call format: stage 4's sampled rollouts make tool calls that parse.
    assert max(m["agentic/tool_calls_per_traj"] for m in steps) > 0, steps
    assert min(m["agentic/invalid_call_rate"] for m in steps) < 1, steps
    # Each step's own draw is recorded group by group, as the step's metrics average it.
    groups = read_groups(smoke_run / "stage4" / "groups.jsonl")
    for m in steps:
        draw = [r for step, _, r in groups if step == m["step"]]
        assert 0 < len(draw) <= m["sampling/groups"]
        assert sum(draw) / len(draw) == pytest.approx(m["sampling/reward_before"])
    summary = json.loads((smoke_run / "summary.json").read_text())
    assert {"before", "after_stage2", "after"} <= set(summary)
    assert (smoke_run / "data" / "stage1.jsonl").stat().st_size > 0


def test_trajectory_store_holds_stage4_and_evaluations(smoke_run: Path, capsys) -> None:
    assert (
        main(
            [
                "trajectories",
                str(smoke_run),
                "--sql",
                "SELECT stage, count(DISTINCT episode) FROM trajectories GROUP BY 1 ORDER BY 1",
            ]
        )
        == 0
    )
    rows = dict(line.split("\t") for line in capsys.readouterr().out.split("\n") if line)
    # Every rollout stage 4 spent is stored, the groups dynamic sampling replaced included.
    metrics = [
        json.loads(x) for x in (smoke_run / "stage4" / "metrics.jsonl").read_text().splitlines()
    ]
    spent = sum(m["sampling/rollouts"] for m in metrics if "sampling/rollouts" in m)
    assert int(rows["eval"]) == 12 and int(rows["stage4"]) == spent >= 8
    # the parsed calls of stage 4 were stepped in the real environment: real observations
    query = (
        "SELECT tool, split_part(observation, chr(10), 1) FROM trajectories "
        "WHERE stage = 'stage4' AND tool IS NOT NULL AND tool <> ''"
    )
    assert main(["trajectories", str(smoke_run), "--sql", query]) == 0
    calls = [line for line in capsys.readouterr().out.split("\n") if line]
    assert calls and all(
        line.split("\t")[1].startswith(("status: ", "verdict: ")) for line in calls
    )
    first = json.loads(
        (smoke_run / "eval" / "before" / "predictions.jsonl").read_text().splitlines()[0]
    )
    assert (
        main(["trajectories", str(smoke_run), "--task", first["instance_id"], "--limit", "1"]) == 0
    )
    assert "turn 0 [assistant]" in capsys.readouterr().out


def test_rerun_resumes_without_training_again(smoke_run: Path, capsys) -> None:
    assert main(["curriculum", "--preset", "smoke", "--output-dir", str(smoke_run.parent)]) == 0
    out = capsys.readouterr().out
    assert out.count("already complete") == 4


def test_report_includes_a_scripted_evaluation(smoke_run: Path, capsys) -> None:
    out = smoke_run / "eval" / "scripted"
    assert (
        main(["eval", "--policy", "scripted", "--limit", "6", "--num-envs", "2", "--out", str(out)])
        == 0
    )
    assert main(["report", str(smoke_run)]) == 0
    html = (smoke_run / "report" / "report.html").read_text()
    assert "<code>scripted</code>" in html and "<code>after_stage4</code>" in html
    capsys.readouterr()
    assert (
        main(
            [
                "trajectories",
                str(smoke_run),
                "--sql",
                "SELECT run, count(DISTINCT episode) FROM trajectories WHERE stage = 'eval' GROUP BY 1 ORDER BY 1",
            ]
        )
        == 0
    )
    assert "scripted\t6" in capsys.readouterr().out
    # every explored statement's own time is in the store, so the report lists the slowest ones
    assert "Slowest SQL statements</h2><table>" in html


def test_report_has_its_plots(smoke_run: Path) -> None:
    html = (smoke_run / "report" / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 5
    for name in ("loss", "learning_rate", "tool_calls", "turns", "success_by_category"):
        assert (smoke_run / "report" / f"{name}.png").stat().st_size > 5_000
    # Rewards are drawn, or said to be all zero in words (tests/test_report.py has both cases).
    reward = smoke_run / "report" / "reward.png"
    assert reward.is_file() or "reward per step (stages 3-4): every value is 0" in html


@pytest.mark.slow
def test_report_renders_in_chromium(smoke_run: Path, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    shot = tmp_path / "report.png"
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            "--window-size=1200,2400",
            (smoke_run / "report" / "report.html").as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    from PIL import Image

    image = Image.open(shot).convert("L")
    colours = image.getcolors(maxcolors=1 << 16)
    assert image.size == (1200, 2400) and colours is not None and len(colours) > 50


def test_eval_modes_and_training_tasks_each_get_a_folder(tmp_path: Path) -> None:
    """``eval.modes`` and ``eval.train_tasks``: single-turn and fit evaluations beside the agent's,
    each with its mode and split in its summary, all in the report's table with intervals."""
    stages_off = [f"stage{i}.enabled=false" for i in range(1, 5)]
    argv = ["curriculum", "--preset", "smoke", "--output-dir", str(tmp_path), *stages_off]
    extra = [
        "eval.after=[]",
        "eval.modes=[agent, single]",
        "eval.train_tasks=2",
        "eval.max_tasks=2",
    ]
    assert main([*argv, *extra, "prompt.schema=linked", "prompt.sample_rows=false"]) == 0
    run = tmp_path / "smoke"
    folders = sorted(p.name for p in (run / "eval").iterdir())
    assert folders == ["before", "before-single", "before-train", "before-train-single"]
    summaries = {f: json.loads((run / "eval" / f / "summary.json").read_text()) for f in folders}
    assert [(s["mode"], s["split"], s["n"]) for s in summaries.values()] == [
        ("agent", "heldout", 2),
        ("single", "heldout", 2),
        ("agent", "train", 2),
        ("single", "train", 2),
    ]
    # The fit evaluations run first: an interrupted evaluation has the cheap figures.
    finished = sorted(folders, key=lambda f: (run / "eval" / f / "summary.json").stat().st_mtime_ns)
    assert finished == ["before-train", "before-train-single", "before", "before-single"]
    # One policy for the round: the first evaluation builds it, the other three reuse it.
    assert [summaries[f]["engines_built"] for f in finished] == [1, 0, 0, 0]
    before = json.loads((run / "summary.json").read_text())["before"]
    assert (before["mode"], before["split"]) == ("agent", "heldout")
    assert [
        (before[k]["mode"], before[k]["split"]) for k in ("single", "train", "train-single")
    ] == [
        ("single", "heldout"),
        ("agent", "train"),
        ("single", "train"),
    ]
    html = (run / "report" / "report.html").read_text()
    assert html.count("<code>0.0 [0.0, 65.8]</code>") == 4  # 0 of 2, with its interval


def test_difficulty_is_a_command_and_reused(tmp_path: Path, capsys) -> None:
    """The oracle passes every task: no task is of useful difficulty; a second call reuses the
    estimate instead of sampling again."""
    argv = ["difficulty", "--preset", "smoke", "--output-dir", str(tmp_path), "--stage", "stage4"]
    assert main([*argv, "--model", "oracle", "stage4.difficulty_samples=2"]) == 0
    record_path = tmp_path / "smoke" / "difficulty" / "stage4.json"
    record = json.loads(record_path.read_text())
    assert record["model"] == "oracle" and record["samples"] == 2 and len(record["tasks"]) == 4
    assert all(r == {"passed": 2, "samples": 2, "p": 1.0} for r in record["tasks"].values())
    assert "0 of 4 tasks have 0 < p < 1 under oracle" in capsys.readouterr().out
    written = record_path.stat().st_mtime_ns
    assert main([*argv, "--model", "oracle", "stage4.difficulty_samples=2"]) == 0
    assert record_path.stat().st_mtime_ns == written
    # An RL stage drawing from the first 3 training tasks estimates those 3, and anew.
    assert (
        main([*argv, "--model", "oracle", "stage4.difficulty_samples=2", "stage4.max_tasks=3"]) == 0
    )
    assert len(json.loads(record_path.read_text())["tasks"]) == 3
    assert "0 of 3 tasks have 0 < p < 1 under oracle" in capsys.readouterr().out
    assert main([*argv, "stage4.max_tasks=0"]) == 2
    assert "stage4.max_tasks must be >= 1" in capsys.readouterr().err


def test_an_rl_stage_draws_from_its_max_tasks(tmp_path: Path, capsys) -> None:
    """stage4.max_tasks=1 hands stage 4 one of the smoke run's 4 training tasks: fewer than a step
    of 2 needs, which the stage refuses, naming the counts."""
    argv = ["curriculum", "--preset", "smoke", "--output-dir", str(tmp_path), "eval.enabled=false"]
    argv += ["stage1.enabled=false", "stage2.enabled=false", "stage3.enabled=false"]
    assert main([*argv, "stage4.max_tasks=1"]) == 2
    assert "1 training task(s) left but stage4.tasks_per_step=2" in capsys.readouterr().err
    assert not (tmp_path / "smoke" / "stage4" / "DONE").exists()


def test_an_interrupted_difficulty_estimate_samples_only_its_missing_parts(tmp_path: Path) -> None:
    """In parts of 3 tasks, the smoke run's 4 tasks make two parts; after an interruption only
    the unfinished part is sampled again, and a part made for another policy, or sampled at
    another temperature, is not reused."""
    argv = ["difficulty", "--preset", "smoke", "--output-dir", str(tmp_path), "--stage", "stage4"]
    argv += ["--model", "oracle", "stage4.difficulty_samples=2", "stage4.difficulty_chunk=3"]
    assert main(argv) == 0
    record_path = tmp_path / "smoke" / "difficulty" / "stage4.json"
    record = json.loads(record_path.read_text())
    parts = tmp_path / "smoke" / "difficulty" / "stage4" / "0"
    assert sorted(p.name for p in parts.iterdir()) == ["0", "1"]
    assert [len((parts / p / "verdicts.jsonl").read_text().splitlines()) for p in "01"] == [6, 2]

    def stamps() -> list[int]:
        return [(parts / p / "verdicts.jsonl").stat().st_mtime_ns for p in "01"]

    before = stamps()
    record_path.unlink()  # killed while part 1 was being sampled: it has no summary yet
    (parts / "1" / "summary.json").unlink()
    assert main(argv) == 0
    after = stamps()
    assert after[0] == before[0] and after[1] != before[1]
    assert json.loads(record_path.read_text()) == record
    summary = json.loads((parts / "0" / "summary.json").read_text())
    settings = {**summary["settings"], "policy": "another"}
    (parts / "0" / "summary.json").write_text(json.dumps({**summary, "settings": settings}))
    record_path.unlink()
    assert main(argv) == 0
    assert stamps()[0] != after[0]
    assert json.loads(record_path.read_text()) == record
    # Sampled otherwise (here at another temperature), no part and no estimate is reused.
    resampled = stamps()
    assert main([*argv, "stage4.temperature=0.5"]) == 0
    assert all(new != old for new, old in zip(stamps(), resampled, strict=True))
    assert json.loads(record_path.read_text())["settings"]["temperature"] == 0.5


def test_difficulty_filter_refuses_a_stage_with_nothing_to_learn(tmp_path: Path, capsys) -> None:
    """The untrained tiny model never passes: the filtered stage stops with the counts and the
    settings to change, and trains nothing."""
    argv = ["stage4", "--preset", "smoke", "--output-dir", str(tmp_path)]
    assert main([*argv, "stage4.difficulty_filter=true", "stage4.difficulty_samples=2"]) == 2
    err = capsys.readouterr().err
    assert "0 of 4 training tasks have 0 < p < 1 at 2 samples (p = 0: 4, p = 1: 0)" in err
    assert "stage4.difficulty_filter=false" in err
    assert (tmp_path / "smoke" / "difficulty" / "stage4.json").is_file()
    assert not (tmp_path / "smoke" / "stage4" / "DONE").exists()

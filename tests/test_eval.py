"""``birdtrain eval``: reference policies score what they must, and their files are official."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from interrupting import HANG

from birdenv import load_tasks
from birdenv.cli import main as birdenv_main
from birdenv.schema import PromptOptions
from birdenv.tools import format_tool_call

pytest.importorskip("duckdb", reason="the trajectory store needs the train extra")

from birdtrain.cli import main
from birdtrain.evaluate import PROGRESS_FILE, evaluate_policy
from birdtrain.models import resolve_model
from birdtrain.prompts import PROMPT_RECORD, prompt_for, record_prompt, recorded_prompt
from birdtrain.stats import paired_difference, pass_at_k, wilson_interval
from birdtrain.trajectory_store import TrajectoryStore

pytestmark = pytest.mark.long  # conftest.py: started first


def _check_time_split(summary: dict) -> None:
    """The time split is a split of the evaluation's wall time: its parts add up to the total."""
    split = summary["time_split"]
    assert set(split) == {"generation_s", "env_s", "judge_s", "other_s"}
    assert all(0 <= v <= summary["seconds"] + 0.01 for v in split.values()), split
    assert abs(sum(split.values()) - summary["seconds"]) < 0.05, split


@pytest.mark.parametrize(
    ("policy", "expected"), [("oracle", 100.0), ("echo", 0.0), ("scripted", 100.0)]
)
def test_reference_policies_on_the_whole_eval_suite(
    policy: str, expected: float, tmp_path: Path
) -> None:
    summary = evaluate_policy(policy, tasks=load_tasks("critic-mini"), out_dir=tmp_path, num_envs=2)
    assert summary["success_rate"] == expected
    assert summary["n"] == len(load_tasks("critic-mini"))
    _check_time_split(summary)
    assert summary["time_split"]["env_s"] > 0 and summary["time_split"]["judge_s"] > 0
    low, high = summary["ci95"]
    assert low <= expected <= high and high - low > 1  # 69 tasks: an interval points wide
    assert {"Query", "Management", "Personalization"} <= set(summary["by_category"])
    assert "(measured here)" in summary["table"] and "BIRD-RL 7B" in summary["table"]


def test_predictions_are_what_the_official_form_expects(tmp_path: Path, capsys) -> None:
    assert (
        main(
            [
                "eval",
                "--policy",
                "oracle",
                "--limit",
                "12",
                "--num-envs",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(set(r) == {"instance_id", "pred_sqls"} for r in rows)
    # the same file, judged again by the evaluator command, gives the same verdicts
    assert (
        birdenv_main(
            ["evaluate", str(tmp_path / "predictions.jsonl"), "--out", str(tmp_path / "v.jsonl")]
        )
        == 0
    )
    again = [json.loads(line)["status"] for line in (tmp_path / "v.jsonl").read_text().splitlines()]
    assert again == ["success"] * 12
    capsys.readouterr()
    assert (
        main(
            [
                "trajectories",
                str(tmp_path),
                "--sql",
                "SELECT count(DISTINCT episode) FROM trajectories",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == "12"


def test_pass_at_k_intervals_and_argument_errors(tmp_path: Path) -> None:
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0
    assert abs(pass_at_k(5, 2, 2) - 0.7) < 1e-9
    # Wilson 95 % intervals (Agresti & Coull 1998, Table: 0/10 -> [0, 0.278], 10/10 -> [0.722, 1]).
    assert [round(x, 3) for x in wilson_interval(0, 10)] == [0.0, 0.278]
    assert [round(x, 3) for x in wilson_interval(10, 10)] == [0.722, 1.0]
    low, high = wilson_interval(40, 100)
    assert low < 0.4 < high and abs((high - low) - 0.19) < 0.01
    assert wilson_interval(0, 0) == (0.0, 1.0)  # no trials: no information
    with pytest.raises(ValueError, match="temperature"):
        evaluate_policy("oracle", tasks=load_tasks("critic-mini")[:1], out_dir=tmp_path, n=2)
    with pytest.raises(ValueError, match="agent"):
        evaluate_policy(
            "oracle", tasks=load_tasks("critic-mini")[:1], out_dir=tmp_path, mode="single"
        )


def test_outcomes_say_how_the_episodes_ended(tmp_path: Path, capsys) -> None:
    """The summary counts answers handed in, issue SQL handed back unchanged and turns holding no
    call that parses: what a success rate of 0 leaves out."""
    tasks = load_tasks("critic-mini")[:6]
    echo = evaluate_policy("echo", tasks=tasks, out_dir=tmp_path / "echo", num_envs=2)
    assert echo["success_rate"] == 0.0
    assert echo["outcomes"] == {
        "episodes": 6,
        "submitted": 6,
        "unchanged": 6,
        "turns": 6,
        "unparsed_turns": 0,
    }
    oracle = evaluate_policy("oracle", tasks=tasks, out_dir=tmp_path / "oracle", num_envs=2)
    assert oracle["outcomes"]["unchanged"] == 0 and oracle["outcomes"]["submitted"] == 6
    capsys.readouterr()
    # A random model writes no call: every turn is unparsed and nothing is handed in.
    argv = ["eval", "--policy", "tiny", "--limit", "2", "--max-turns", "2", "--max-new-tokens"]
    assert main([*argv, "4", "--num-envs", "2", "--out", str(tmp_path / "tiny")]) == 0
    assert "0/2 submitted (0 unchanged), 4/4 turns unparsed" in capsys.readouterr().out
    summary = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    assert summary["outcomes"]["unparsed_turns"] == summary["outcomes"]["turns"] == 4


def test_a_paired_comparison_sees_a_rise_that_separate_intervals_do_not() -> None:
    """Ten tasks of mixed difficulty, 8 samples each; every task passes 1 or 2 samples more after.
    Pooled, the two rates' Wilson intervals overlap; compared task by task, the rise is clear."""
    before = [0, 1, 1, 2, 3, 4, 5, 5, 6, 0]
    after = [1, 3, 2, 4, 4, 6, 6, 7, 7, 2]
    a = {f"t{i}": [s < c for s in range(8)] for i, c in enumerate(before)}
    b = {f"t{i}": [s < c for s in range(8)] for i, c in enumerate(after)}
    low_b, _ = wilson_interval(sum(after), 80)
    _, high_a = wilson_interval(sum(before), 80)
    assert low_b < high_a  # the separate intervals overlap
    d = paired_difference(a, b)
    assert d["improved"] == 10 and d["worsened"] == 0 and d["ci95"][0] > 0.1
    assert abs(d["difference"] - (sum(after) - sum(before)) / 80) < 1e-12
    # The same pooled rate spread unevenly over the tasks: task by task, that is noise.
    noisy = {
        f"t{i}": [s < c for s in range(8)] for i, c in enumerate([8, 0, 4, 0, 8, 8, 0, 8, 2, 4])
    }
    assert paired_difference(a, noisy)["ci95"][0] < 0 < paired_difference(a, noisy)["ci95"][1]


@pytest.mark.parametrize("tasks", [5, 10, 24])
def test_a_paired_comparison_of_equal_policies_calls_a_change_one_time_in_twenty(
    tasks: int,
) -> None:
    """Two policies with the same pass rate on every task (mixed difficulty, 8 samples a task):
    the 95 % interval excludes 0 in ~5 % of 2,000 seeded trials, on few tasks as on many. An
    interval too narrow for few tasks (a percentile bootstrap gives ~10 % on 10) fails here."""
    rng = random.Random(tasks)
    changes = 0
    for _ in range(2000):
        rates = [rng.choice([0.1, 0.25, 0.5, 0.75, 0.9]) for _ in range(tasks)]
        a, b = (
            {f"t{i}": [rng.random() < p for _ in range(8)] for i, p in enumerate(rates)}
            for _ in range(2)
        )
        low, high = paired_difference(a, b)["ci95"]
        changes += low > 0 or high < 0
    assert 0.03 <= changes / 2000 <= 0.07, changes / 2000


def test_compare_two_evaluations_task_by_task(tmp_path: Path, capsys) -> None:
    """``birdtrain compare`` pairs two evaluations by task: the oracle beats the echo on every
    shared task, an evaluation equals itself, and tasks only one side holds are left out."""
    argv = ["eval", "--suite", "critic-mini", "--num-envs", "2"]
    assert main([*argv, "--policy", "echo", "--limit", "4", "--out", str(tmp_path / "e")]) == 0
    assert main([*argv, "--policy", "oracle", "--limit", "6", "--out", str(tmp_path / "o")]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "e"), str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "echo: 0.0% (1 sample a task)" in out and "oracle: 100.0% (1 sample a task)" in out
    assert "difference +100.0 points, 95 % interval +100.0 to +100.0" in out
    assert "paired over 4 tasks: rose on 4, fell on 0" in out
    assert "left out: 0 tasks only in A, 2 only in B" in out
    assert main(["compare", str(tmp_path / "o"), str(tmp_path / "o"), "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["tasks"] == 6 and same["difference"] == 0.0 and same["ci95"] == [0.0, 0.0]
    assert same["labels"] == ["oracle", "oracle"] and same["improved"] == same["worsened"] == 0
    # A broken verdict row is named by file and line; nothing is compared.
    rows = (tmp_path / "e" / "verdicts.jsonl").read_text().splitlines()
    (tmp_path / "e" / "verdicts.jsonl").write_text("\n".join([rows[0], "{oops", *rows[1:]]))
    assert main(["compare", str(tmp_path / "e"), str(tmp_path / "o")]) == 2
    assert "verdicts.jsonl:2: not a verdict row" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "missing"), str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err


# -- BIRD questions: execution accuracy --------------------------------------------------------
@pytest.mark.parametrize(
    ("policy", "expected"), [("oracle", 100.0), ("echo", 0.0), ("scripted", 100.0)]
)
def test_reference_policies_on_bird_mini_eval(policy: str, expected: float, tmp_path: Path) -> None:
    from birdenv.tasks import load_bird

    questions = load_bird("bird-mini-eval")
    summary = evaluate_policy(policy, tasks=questions, out_dir=tmp_path, num_envs=2)
    assert (summary["metric"], summary["task"]) == ("EX", "generation")
    assert summary["execution_accuracy"] == summary["success_rate"] == expected
    assert summary["n"] == len(questions)
    assert set(summary["by_difficulty"]) == {"simple", "moderate", "challenging"}
    assert all(v["success_rate"] == expected for v in summary["by_difficulty"].values())
    assert "EX %" in summary["table"] and "BIRD dev (paper)" in summary["table"]
    # BIRD's official prediction file: {question_id: "SQL\t----- bird -----\tdb_id"}.
    official = json.loads((tmp_path / "predict.json").read_text())
    first = questions[0]
    sql, marker, db_id = official[first.instance_id].split("\t")
    assert (marker, db_id) == ("----- bird -----", first.db_id)
    assert (sql == first.SQL) == (expected == 100.0)


def test_bird_eval_from_the_command_line_and_from_files(tmp_path: Path, capsys) -> None:
    from birdenv import suites
    from birdenv.tasks import load_bird

    assert (
        main(
            [
                "eval",
                "--policy",
                "oracle",
                "--suite",
                "bird-mini-eval",
                "--limit",
                "5",
                "--num-envs",
                "2",
                "--out",
                str(tmp_path / "suite"),
            ]
        )
        == 0
    )
    assert "oracle by difficulty" in capsys.readouterr().out
    # The official layout: a JSON array file and {db_root}/{db_id}/{db_id}.sqlite.
    questions = load_bird("bird-mini-eval")[:4]
    path = tmp_path / "dev.json"
    path.write_text(json.dumps([q.to_dict() for q in questions]))
    db_root = suites.ensure().db_dir
    assert (
        main(
            [
                "eval",
                "--policy",
                "echo",
                "--tasks",
                str(path),
                "--db-root",
                str(db_root),
                "--num-envs",
                "1",
                "--out",
                str(tmp_path / "file"),
            ]
        )
        == 0
    )
    summary = json.loads((tmp_path / "file" / "summary.json").read_text())
    assert (summary["n"], summary["execution_accuracy"]) == (4, 0.0)


def test_bird_single_mode_and_one_kind_per_evaluation(tmp_path: Path) -> None:
    from birdenv.tasks import load_bird

    questions = load_bird("bird-mini-eval")[:1]
    with pytest.raises(ValueError, match="evaluate each kind on its own"):
        evaluate_policy("oracle", tasks=load_tasks("critic-mini")[:1] + questions, out_dir=tmp_path)
    with pytest.raises(ValueError, match="agent"):
        evaluate_policy("oracle", tasks=questions, out_dir=tmp_path, mode="single")
    # A model answers once; its <solution>'s last statement is scored by execution accuracy.
    summary = evaluate_policy(
        "tiny",
        tasks=load_bird("bird-mini-eval")[:2],
        out_dir=tmp_path,
        mode="single",
        max_new_tokens=8,
    )
    assert (summary["metric"], summary["n"], summary["execution_accuracy"]) == ("EX", 2, 0.0)
    assert summary["outcomes"] == {"episodes": 2, "submitted": 0}  # no <solution>; no issue SQL
    _check_time_split(summary)
    assert summary["time_split"]["generation_s"] > 0  # judging two answers may round to 0.0 s
    verdicts = [json.loads(x) for x in (tmp_path / "verdicts.jsonl").read_text().splitlines()]
    assert [v["status"] for v in verdicts] == ["failed", "failed"]
    assert all(v["verdict"]["instance_id"] == v["instance_id"] for v in verdicts)
    # Each answer is in the trajectory store as it was written, with its verdict.
    stored = TrajectoryStore(tmp_path).query(
        "SELECT task_id, mode, turn, tool, observation, verdict, reward, action, sql, error "
        "FROM trajectories ORDER BY task_id"
    )
    assert [r[:7] for r in stored] == [
        (q.instance_id, "single", 0, None, None, "failed", 0.0)
        for q in sorted(load_bird("bird-mini-eval")[:2], key=lambda q: q.instance_id)
    ]
    for *_, action, sql, error in stored:
        assert action  # the model's text, whatever it wrote
        assert (sql is None) == (error == "no <solution> in the answer")


# -- an agent behind an OpenAI-compatible endpoint ------------------------------------------------
def test_an_endpoint_agent_speaks_openai_tool_calls_and_is_labelled_by_its_model(
    tmp_path: Path, chat_server, capsys
) -> None:
    """The strict endpoint refuses a conversation that is not in OpenAI's tool-calling form, and
    the results go under the endpoint's model name."""
    task = load_tasks("critic-mini")[0]
    explore = "Look first.\n" + format_tool_call("execute_sql", sql="SELECT 1")
    chat_server.scripted = [explore, format_tool_call("submit_solution", sql_list=task.sol_sql)]
    before = len(chat_server.requests)
    argv = ["eval", "--endpoint", chat_server.url, "--endpoint-model", "qwen-test", "--limit", "1"]
    assert main([*argv, "--num-envs", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "qwen-test (measured here)" in out and "[eval qwen-test] SR 100.00%" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["label"], summary["success_rate"]) == ("qwen-test", 100.0)
    _check_time_split(summary)
    assert TrajectoryStore(tmp_path).query("SELECT DISTINCT run FROM trajectories") == [
        ("qwen-test",)
    ]
    first, second = chat_server.requests[before:]
    assert first["model"] == "qwen-test" and len(first["messages"]) == 1
    call, answer = second["messages"][1:]
    assert call["role"] == "assistant" and call["content"] == "Look first."
    assert call["tool_calls"][0]["function"]["name"] == "execute_sql"
    assert answer["role"] == "tool" and answer["tool_call_id"] == call["tool_calls"][0]["id"]
    assert answer["content"].startswith("status: ok")


# -- bad input: one line naming what is wrong, exit status 2 --------------------------------------
def _one_line_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("birdtrain: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_eval_of_an_unknown_suite(capsys) -> None:
    assert "nope" in _one_line_error(["eval", "--policy", "oracle", "--suite", "nope"], capsys)


def test_eval_of_a_model_path_that_does_not_exist(tmp_path: Path, capsys) -> None:
    argv = ["eval", "--policy", "/no/such/dir", "--limit", "1", "--out", str(tmp_path)]
    err = _one_line_error(argv, capsys)
    assert "no model at /no/such/dir; names: tiny, smollm" in err


def test_curriculum_with_malformed_yaml(tmp_path: Path, capsys) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("name: mine\nstage3:\n  learning_rate: [1e-6\n")
    err = _one_line_error(["curriculum", "--config", str(path)], capsys)
    assert f"{path}:4:1: not valid YAML" in err


@pytest.mark.stack
def test_an_evaluation_computes_in_the_dtype_asked(tmp_path: Path) -> None:
    """``--dtype bfloat16`` samples under autocast: the model's layers compute in bfloat16, and
    the summary says which dtype the figures come from."""
    import torch

    from birdtrain.policies import generation_policy

    argv = ["eval", "--policy", "tiny", "--suite", "critic-mini", "--limit", "1", "--mode"]
    argv += ["single", "--max-new-tokens", "4", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["dtype"] == "float32"
    assert main([*argv, "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["dtype"] == "bfloat16"

    policy = generation_policy("tiny", engine="transformers", dtype="bfloat16")
    computed: list[torch.dtype] = []
    layer = next(m for m in policy.model.modules() if isinstance(m, torch.nn.Linear))
    layer.register_forward_hook(lambda module, inputs, output: computed.append(output.dtype))
    policy.generate([policy.tokenizer("SELECT 1")["input_ids"]], max_new_tokens=2, temperature=0)
    assert set(computed) == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16"):
        generation_policy("tiny", engine="transformers", dtype="int8")


@pytest.mark.stack
def test_an_evaluation_reads_prompts_as_the_checkpoint_learned_them(tmp_path: Path, capsys) -> None:
    """A checkpoint trained on linked prompts without rows is evaluated on those by default (a
    model shown the full schema it never saw scores what it never learned); flags override one
    option at a time; a broken record is an error, not a silent fall-back to the full schema."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(resolve_model("tiny"), checkpoint)
    record_prompt(checkpoint, PromptOptions(schema="linked", sample_rows=False))
    argv = ["eval", "--policy", str(checkpoint), "--suite", "critic-mini", "--limit", "1"]
    argv += ["--max-turns", "1", "--max-new-tokens", "4", "--num-envs", "1"]

    def prompt_of(*flags: str, mode: str = "agent") -> dict:
        out = tmp_path / f"eval-{mode}-{len(flags)}"
        assert main([*argv, "--mode", mode, "--out", str(out), *flags]) == 0
        return json.loads((out / "summary.json").read_text())["prompt"]

    assert prompt_of() == {"schema": "linked", "sample_rows": False}
    assert prompt_of(mode="single") == {"schema": "linked", "sample_rows": False}
    assert prompt_of("--schema", "full") == {"schema": "full", "sample_rows": False}
    assert prompt_of("--schema", "named", "--sample-rows") == {
        "schema": "named",
        "sample_rows": True,
    }
    # Without a record (a base model, a name), the benchmark's own form.
    assert recorded_prompt("tiny") is None
    assert prompt_for("tiny") == PromptOptions(schema="full", sample_rows=True)

    (checkpoint / PROMPT_RECORD).write_text('{"schema": "short"}')
    capsys.readouterr()  # what the evaluations above printed
    err = _one_line_error([*argv, "--out", str(tmp_path / "broken")], capsys)
    assert f"{checkpoint / PROMPT_RECORD}: not a prompt setting" in err
    assert "schema must be one of 'full', 'linked', 'named'" in err


def test_num_envs_is_how_many_episodes_play_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """``birdtrain eval --num-envs`` (a curriculum's ``eval.num_envs``) sets the width of the
    batches the model generates for: in single mode, that many prompts a batch."""
    from birdtrain.policies import TransformersPolicy

    widths: list[int] = []
    generate = TransformersPolicy.generate

    def recorded(self: TransformersPolicy, batch: list[list[int]], **kwargs: object) -> list:
        widths.append(len(batch))
        return generate(self, batch, **kwargs)

    monkeypatch.setattr(TransformersPolicy, "generate", recorded)
    argv = ["eval", "--policy", "tiny", "--suite", "critic-mini", "--limit", "5"]
    argv += ["--mode", "single", "--max-new-tokens", "4", "--out", str(tmp_path / "eval")]
    assert main([*argv, "--num-envs", "2"]) == 0
    assert widths == [2, 2, 1]
    widths.clear()
    assert main([*argv, "--num-envs", "8"]) == 0
    assert widths == [5]
    capsys.readouterr()
    assert main([*argv, "--num-envs", "0"]) == 2
    assert "num_envs must be >= 1, got 0" in capsys.readouterr().err

    widths.clear()
    stages_off = [f"stage{i}.enabled=false" for i in range(1, 5)]
    argv = ["curriculum", "--preset", "smoke", "--output-dir", str(tmp_path), *stages_off]
    argv += ["eval.after=[]", "eval.modes=[single]", "eval.max_tasks=5", "eval.max_new_tokens=4"]
    assert main([*argv, "eval.num_envs=3"]) == 0
    assert widths == [3, 2]
    capsys.readouterr()
    assert main([*argv, "eval.num_envs=0"]) == 2
    assert "eval.num_envs must be >= 1, got 0" in capsys.readouterr().err


def _interrupted(argv: list[str], out: Path, saved: int) -> int:
    """Run ``birdtrain eval`` in a process of its own and kill it (SIGKILL: nothing to clean up)
    once ``saved`` episodes are in its progress file; return how many lines the file held."""
    progress = out / PROGRESS_FILE
    command = [sys.executable, "-m", "birdtrain", *argv, "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + HANG  # the model's load and the episodes, on a loaded machine
        while time.monotonic() < deadline and process.poll() is None:
            if progress.is_file() and len(progress.read_text().splitlines()) > saved:
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"no {saved} episodes saved: {process.stderr.read().decode()[-2000:]}")
    finally:
        process.kill()
        process.wait()
    assert not (out / "summary.json").exists(), "the evaluation ended before it was interrupted"
    return len(progress.read_text().splitlines())


def _verdict_rows(out: Path) -> list[dict]:
    """The rows of ``verdicts.jsonl`` less what differs between two runs of one evaluation (how
    long the judge took, whether it found the issue phase cached)."""
    rows = [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()]
    for row in rows:
        for key in ("timings", "issue_cached"):
            (row["verdict"] or {}).pop(key, None)
    return rows


@pytest.mark.parametrize(
    ("mode", "limit", "saved"), [("agent", 6, 2), ("single", 9, 8)], ids=["agent", "single"]
)
def test_an_interrupted_evaluation_resumes_where_it_stopped(
    mode: str, limit: int, saved: int, tmp_path: Path, capsys
) -> None:
    """A killed evaluation, run again into its folder, keeps what it had finished, plays the
    rest, and ends with the verdicts of an evaluation that was never interrupted. Under other
    settings it refuses to resume and keeps the file; a broken line is named."""
    argv = ["eval", "--policy", "tiny", "--suite", "critic-mini", "--limit", str(limit)]
    argv += ["--mode", mode, "--max-turns", "2", "--max-new-tokens", "12", "--num-envs", "1"]
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    assert not (tmp_path / "whole" / PROGRESS_FILE).exists()  # gone once the summary is written

    out = tmp_path / "resumed"
    lines = _interrupted(argv, out, saved)
    assert saved < lines <= limit  # the header, then one episode a line
    before = (out / PROGRESS_FILE).read_text()
    capsys.readouterr()
    assert main([*argv, "--temperature", "0.5", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "other settings (temperature: 0.0 there, 0.5 here)" in err
    assert (out / PROGRESS_FILE).read_text() == before  # nothing lost

    assert main([*argv, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_tasks"] == lines - 1 and summary["earlier_seconds"] > 0
    assert f"resumed {lines - 1} finished tasks" in capsys.readouterr().out
    assert not (out / PROGRESS_FILE).exists()
    whole, resumed = _verdict_rows(tmp_path / "whole"), _verdict_rows(out)
    assert len(resumed) == limit
    assert resumed == whole  # the same tasks, answers and verdicts, in the same order
    # Every episode is in the store once, the kept ones and the new ones.
    turns = TrajectoryStore(out).query("SELECT task_id, count(*) FROM trajectories GROUP BY 1")
    assert sorted(turns) == sorted(
        TrajectoryStore(tmp_path / "whole").query(
            "SELECT task_id, count(*) FROM trajectories GROUP BY 1"
        )
    )

    # A line torn by the interruption is dropped; a broken line before the last is an error.
    header, first = before.splitlines()[:2]
    (out / PROGRESS_FILE).write_text(f"{header}\n{first}\n{first[:40]}\n")
    assert main([*argv, "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_tasks"] == 1
    assert _verdict_rows(out) == whole
    # A run that failed before its first episode leaves nothing to resume, whatever its settings.
    other = header.replace('"temperature": 0.0', '"temperature": 0.5')
    assert other != header
    (out / PROGRESS_FILE).write_text(f"{other}\n")
    assert main([*argv, "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_tasks"] == 0
    (out / PROGRESS_FILE).write_text(f"{header}\nnot json\n{first}\n")
    capsys.readouterr()
    assert main([*argv, "--out", str(out)]) == 2
    assert f"{out / PROGRESS_FILE}:2: not a saved episode" in capsys.readouterr().err


def test_an_evaluation_whose_results_cannot_be_written_stores_its_episodes_once(
    tmp_path: Path, capsys
) -> None:
    """Its episodes are played, but a result file cannot be written: a clear error naming the
    folder and the kept episodes. Run again, it finishes from those without playing them again,
    and the trajectory store holds each episode once, though both runs wrote it."""
    out = tmp_path / "oracle"
    argv = ["eval", "--policy", "oracle", "--suite", "critic-mini", "--limit", "4"]
    argv += ["--num-envs", "2", "--out", str(out)]
    out.mkdir()
    (out / "predictions.jsonl").mkdir()  # in the way of the file the evaluation writes last
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot write the evaluation's results into {out}" in err
    assert f"its episodes are kept in {out / PROGRESS_FILE}" in err
    header, *episodes = (out / PROGRESS_FILE).read_text().splitlines()
    assert len(episodes) == 4
    count = "SELECT count(DISTINCT task_id), count(*) FROM trajectories"
    tasks, rows = TrajectoryStore(out).query(count)[0]
    assert tasks == 4 and rows >= 4

    # The store's own file cannot be written: the error names it, and nothing half-written stays.
    (out / "predictions.jsonl").rmdir()
    staging = out / "trajectories" / f"part-eval-{json.loads(header)['id']}.tmp"
    staging.mkdir()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot write {staging.with_suffix('.parquet')}" in err
    staging.rmdir()

    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_tasks"] == 4 and summary["success_rate"] == 100.0
    assert TrajectoryStore(out).query(count)[0] == (4, rows)
    assert len(TrajectoryStore(out).files()) == 1


def test_an_evaluation_on_a_full_disk_keeps_what_it_saved(mount_tmpfs, capsys) -> None:
    """The disk fills while an evaluation saves its episodes: a clear error naming the file, the
    whole lines saved before kept, and with room made the same command resumes from them."""
    disk = mount_tmpfs("96k")
    out = disk / "oracle"
    argv = ["eval", "--policy", "oracle", "--suite", "critic-mini", "--num-envs", "2"]
    argv += ["--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot save the evaluation's progress in {out / PROGRESS_FILE}" in err
    assert "No space left on device" in err
    saved = 0
    for line in (out / PROGRESS_FILE).read_text().splitlines()[1:]:
        with contextlib.suppress(json.JSONDecodeError):  # the line the disk cut short
            json.loads(line)
            saved += 1
    assert 0 < saved < 69

    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_tasks"] == saved
    assert summary["success_rate"] == 100.0 and summary["n"] == 69

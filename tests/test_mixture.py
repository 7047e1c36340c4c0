"""Mixed-task curricula: weighted draws, one vector env of both kinds, data, rewards, the run.

Debugging tasks (gym-mini, critic-mini) and BIRD questions (bird-mini-train, bird-mini-eval) on
the bundled databases, real sessions and the real judge / execution accuracy throughout.
"""

from __future__ import annotations

import collections
import contextlib
import doctest
import json
from pathlib import Path

import numpy as np
import pytest

from birdenv.tasks import BirdTask, Task, load_tasks
from birdenv.tools import format_tool_call
from birdenv.vector import MixedTaskEnv, make_vec
from birdtrain.config import load_config, parse_mixture
from birdtrain.curriculum.mixture import candidate_weights, resolve_mixture
from birdtrain.data import load_train_tasks
from birdtrain.data.bird import bird_reference_turns, wrong_column_sql
from birdtrain.data.mixture import apportion, mix_tasks
from birdtrain.trajectory_store import TrajectoryStore

MIX = {"gym-mini": 0.7, "bird-mini-train": 0.3}


def test_doctests_of_the_mixture_modules() -> None:
    import birdtrain.curriculum.mixture
    import birdtrain.data.mixture
    import birdtrain.rewards

    for module in (birdtrain.data.mixture, birdtrain.curriculum.mixture, birdtrain.rewards):
        failed, attempted = doctest.testmod(module)
        assert attempted > 0 and failed == 0, module.__name__


def test_weighted_draw_has_exact_proportions_and_is_reproducible() -> None:
    sources = {name: load_tasks(name) for name in MIX}
    draw = mix_tasks(sources, MIX, total=50, seed=3)
    kinds = collections.Counter(t.kind for t in draw)
    assert kinds == {"critic": 35, "bird": 15}
    assert [t.instance_id for t in draw] == [
        t.instance_id for t in mix_tasks(sources, MIX, total=50, seed=3)
    ]
    other = mix_tasks(sources, MIX, total=50, seed=4)
    assert [t.instance_id for t in other] != [t.instance_id for t in draw]
    # Interleaved, not one block per source: BIRD questions are spread over the list.
    positions = [i for i, t in enumerate(draw) if isinstance(t, BirdTask)]
    assert positions[0] < 25 and positions[-1] >= 25
    # No repeats by default: as many as the scarcer share allows (155 / 0.7 = 221).
    full = mix_tasks(sources, MIX, seed=0)
    assert len(full) == 221 and len({t.instance_id for t in full}) == 221
    # More than a source holds: it is cycled through, every task before any repeat.
    small = {"a": ["x", "y"], "b": ["z"]}
    many = mix_tasks(small, {"a": 3, "b": 1}, total=8, seed=0)
    assert collections.Counter(many) == {"x": 3, "y": 3, "z": 2}
    assert apportion({"a": 1, "b": 1, "c": 1}, 10) == {"a": 4, "b": 3, "c": 3}


def test_sampling_by_weight_over_many_draws() -> None:
    rng = np.random.default_rng(0)
    weights = {"a": 0.2, "b": 0.5, "c": 0.3}
    sources = {name: [f"{name}{i}" for i in range(int(rng.integers(5, 40)))] for name in weights}
    draw = mix_tasks(sources, weights, total=1000, seed=1)
    counts = collections.Counter(item[0] for item in draw)
    assert counts == {"a": 200, "b": 500, "c": 300}


def test_mixture_configuration_forms_and_errors() -> None:
    yaml_form = load_config(
        "smoke", overrides=["data.mixture={gym-mini: 0.7, bird-mini-train: 0.3}"]
    )
    text_form = load_config("smoke", overrides=["data.mixture=gym-mini:0.7,bird-mini-train:0.3"])
    assert yaml_form.data.mixture == text_form.data.mixture == MIX
    assert load_config("smoke", overrides=["data.mixture=auto"]).data.mixture == "auto"
    for bad, message in [
        ("data.mixture={gym-mini: -1}", "finite number >= 0"),
        ("data.mixture={gym-mini: 0}", "all 0"),
        ("data.mixture=gym-mini", "NAME:WEIGHT"),
        ("data.mixture_holdout=0", "at least 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_config("smoke", overrides=[bad])
    assert parse_mixture(None) is None
    assert candidate_weights(["a", "b", "c"], 4) == [
        {"a": 0.25, "b": 0.25, "c": 0.5},
        {"a": 0.25, "b": 0.5, "c": 0.25},
        {"a": 0.5, "b": 0.25, "c": 0.25},
    ]


def test_train_tasks_follow_the_mixture_and_the_seed() -> None:
    cfg = load_config("smoke", overrides=["data.max_train_tasks=10", "seed=5"])
    cfg.data.mixture = {"gym-mini": 1, "bird-mini-train": 1}
    tasks = load_train_tasks(cfg)
    assert collections.Counter(t.kind for t in tasks) == {"critic": 5, "bird": 5}
    assert [t.instance_id for t in tasks] == [t.instance_id for t in load_train_tasks(cfg)]
    cfg.data.mixture = None
    assert [t.instance_id for t in load_train_tasks(cfg)] == [
        t.instance_id for t in load_tasks("gym-mini")[:10]
    ]
    cfg.data.mixture = "auto"
    with pytest.raises(ValueError, match="estimate the weights first"):
        load_train_tasks(cfg)


def test_auto_mixture_reuses_the_runs_estimate(tmp_path: Path) -> None:
    cfg = load_config("smoke", overrides=["data.mixture=auto"])
    (tmp_path / "mixture.json").write_text(json.dumps({"chosen": {"gym-mini": 0.25, "x": 0.75}}))
    assert resolve_mixture(cfg, tmp_path) == {"gym-mini": 0.25, "x": 0.75}
    assert cfg.data.mixture == {"gym-mini": 0.25, "x": 0.75}


def _submit(sqls: list[str]) -> str:
    return format_tool_call("submit_solution", sql_list=sqls)


def _step_both(envs, critic: Task, bird: BirdTask, actions: list[str]):
    """Reset copy 0 on ``critic`` and copy 1 on ``bird``, then step both with ``actions``."""
    _, info0 = envs.reset(
        options={"task_id": critic.instance_id, "reset_mask": np.array([1, 0], bool)}
    )
    _, info1 = envs.reset(
        options={"task_id": bird.instance_id, "reset_mask": np.array([0, 1], bool)}
    )
    assert (info0["source"][0], info1["source"][1]) == ("critic", "bird")
    return envs.step(actions)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_one_vector_env_steps_both_kinds(asynchronous: bool) -> None:
    critic = [t for t in load_tasks("critic-mini") if t.db_id == "hospital_records"][:2]
    bird = [t for t in load_tasks("bird-mini-eval") if t.db_id == "hospital_records"][:2]
    with contextlib.closing(
        make_vec(2, tasks=critic + bird, asynchronous=asynchronous, max_episode_steps=4)
    ) as envs:
        assert envs.single_observation_space == envs.single_action_space
        explore = format_tool_call("execute_sql", sql="SELECT count(*) AS n FROM sqlite_master")
        obs, reward, terminated, _, info = _step_both(envs, critic[0], bird[0], [explore] * 2)
        assert all(o.startswith("status: ok\nrows: 1\n| n |") for o in obs)
        assert not terminated.any() and not reward.any()
        assert list(info["category"]) == [critic[0].category, bird[0].difficulty]
        # Each kind judged its own way: the judge for the fix, execution accuracy for the query.
        gold = [_submit(list(critic[0].sol_sql)), _submit([bird[0].SQL])]
        _, reward, terminated, _, info = envs.step(gold)
        assert terminated.all() and list(reward) == [1.0, 1.0]
        assert list(info["verdict"]["status"]) == ["success", "success"]
        envs.step(["", ""])  # drain next-step autoreset
        wrong = [_submit(list(critic[1].issue_sql)), _submit([wrong_column_sql(bird[1])])]
        _, reward, terminated, _, _ = _step_both(envs, critic[1], bird[1], wrong)
        assert terminated.all() and list(reward) == [0.0, 0.0]


def test_mixed_env_draws_sources_by_weight_reproducibly() -> None:
    sources = {"debug": "critic-mini", "sql": "bird-mini-eval"}
    env = MixedTaskEnv(sources, {"debug": 0.8, "sql": 0.2})
    try:
        draws = [env.reset(seed=0 if i == 0 else None)[1]["source"] for i in range(300)]
        again = [env.reset(seed=0 if i == 0 else None)[1]["task_id"] for i in range(20)]
        first = [env.reset(seed=0 if i == 0 else None)[1]["task_id"] for i in range(20)]
    finally:
        env.close()
    share = draws.count("sql") / len(draws)
    assert 0.13 < share < 0.27, share
    assert again == first
    with pytest.raises(ValueError, match="unique across"):
        MixedTaskEnv({"a": "critic-mini", "b": "critic-mini"})
    with pytest.raises(ValueError, match="weights name"):
        MixedTaskEnv(sources, {"debug": 1.0})
    with pytest.raises(KeyError, match="unknown task_id"):
        MixedTaskEnv({"a": "bird-mini-eval"}).reset(options={"task_id": "nope"})


def test_mixed_env_passes_gymnasiums_checker() -> None:
    from gymnasium.utils.env_checker import check_env

    env = MixedTaskEnv(
        {"critic": "critic-mini", "bird": "bird-mini-eval"}, {"critic": 1, "bird": 1}
    )
    try:
        check_env(env, skip_render_check=True)
    finally:
        env.close()


def test_make_vec_keeps_its_single_kind_behaviour(tmp_path: Path) -> None:
    from birdenv import suites

    # A BIRD file (the official JSONL form) gets BirdSQL copies, like a BIRD suite does.
    path = tmp_path / "questions.jsonl"
    path.write_text(
        "".join(json.dumps(q.to_dict()) + "\n" for q in load_tasks("bird-mini-eval")[:3])
    )
    db_dir = str(suites.ensure().db_dir)
    with contextlib.closing(
        make_vec(1, tasks=str(path), db_dir=db_dir, asynchronous=False)
    ) as envs:
        prompts, _ = envs.reset(seed=0)
        assert "# Question:" in prompts[0]
    with contextlib.closing(make_vec(2, asynchronous=False, seed=1)) as envs:
        prompts, info = envs.reset()
        assert all("# User issue:" in p for p in prompts) and "source" not in info
    with contextlib.closing(make_vec(2, suite="bird-mini-eval", asynchronous=False)) as envs:
        prompts, info = envs.reset(seed=0)
        assert all("# Question:" in p for p in prompts)
        assert set(info["category"]) <= {"simple", "moderate", "challenging"}
    with contextlib.closing(
        make_vec(1, mixture={"critic-mini": 1, "bird-mini-eval": 3}, asynchronous=False, seed=2)
    ) as envs:
        sources = collections.Counter(envs.reset()[1]["source"][0] for _ in range(200))
    assert 110 < sources["bird-mini-eval"] < 190, sources


def test_solution_reward_scores_each_kind_its_own_way() -> None:
    from birdtrain.prompts import format_answer
    from birdtrain.rewards import solution_reward

    critic = load_tasks("gym-mini")[0]
    bird = load_tasks("bird-mini-train")[0]
    completions = [
        format_answer("fixed", list(critic.sol_sql)),
        format_answer("found", [bird.SQL]),
        format_answer("wrong", list(critic.issue_sql)),
        format_answer("wrong", [wrong_column_sql(bird)]),
        format_answer("explored first", ["SELECT 1", bird.SQL]),  # the last statement answers
    ]
    ids = [critic.instance_id, bird.instance_id, critic.instance_id, bird.instance_id]
    ids.append(bird.instance_id)
    assert solution_reward([None] * 5, completions, task_id=ids) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_bird_reference_plans_and_synth_of_a_mixture(tmp_path: Path) -> None:
    from birdtrain.data import synth

    bird = load_tasks("bird-mini-train")[0]
    assert bird_reference_turns("oracle", bird)[-1] == _submit([bird.SQL])
    with pytest.raises(ValueError, match="no fixed plan"):
        bird_reference_turns("scripted", bird)
    cfg = load_config("smoke", overrides=["data.max_train_tasks=6", "stage4.max_turns=4"])
    cfg.data.mixture = {"gym-mini": 2, "bird-mini-train": 1}
    counts = synth(cfg, tmp_path)
    assert (counts["critic_tasks"], counts["bird_tasks"]) == (4, 2)
    stage1 = [json.loads(x) for x in (tmp_path / "stage1.jsonl").read_text().splitlines()]
    stage2 = [json.loads(x) for x in (tmp_path / "stage2.jsonl").read_text().splitlines()]
    bird_ids = {t.instance_id for t in load_tasks("bird-mini-train")}
    for rows in (stage1, stage2):
        assert sum(r["task_id"] in bird_ids for r in rows) == 2 and len(rows) == 6
    bird1 = next(r for r in stage1 if r["task_id"] in bird_ids)
    assert "# Question:" in bird1["prompt"][0]["content"]
    assert "<solution>" in bird1["completion"][0]["content"]
    bird2 = next(r for r in stage2 if r["task_id"] in bird_ids)
    # A real BirdSQL episode: explored, then submitted, and the environment said "success".
    roles = [m["role"] for m in bird2["messages"]]
    assert roles[0] == "user" and roles.count("assistant") == 4
    assert bird2["messages"][-1]["content"].startswith("verdict: success")


# -- the curriculum on a mixture -----------------------------------------------------------------
_TWO_TASK_MIX = "data.mixture={gym-mini: 0.5, bird-mini-train: 0.5}"
# One step per stage and one-turn evaluations on two tasks of each kind: every stage and both
# metrics run, in a fraction of the smoke preset's time.
_FAST = [
    _TWO_TASK_MIX,
    "stage1.max_steps=1",
    "stage2.max_steps=1",
    "stage3.max_steps=1",
    "stage4.max_steps=1",
    "stage3.max_completion_length=16",
    "stage4.max_turns=2",
    "stage4.max_new_tokens=16",
    "stage4.vector=sync",
    "eval.max_tasks=2",
    "eval.after=[stage4]",
    "eval.max_turns=1",
    "eval.max_new_tokens=8",
]


def _check_mixed_run(run: Path, eval_tasks: int, labels: tuple[str, ...]) -> None:
    from birdtrain.cli import main

    bird_ids = {t.instance_id for t in load_tasks("bird-mini-train")}
    for stage in ("stage1", "stage2", "stage3", "stage4"):
        assert (run / stage / "DONE").is_file(), stage
    data = json.loads((run / "data" / "DONE").read_text())
    assert data["critic_tasks"] == data["bird_tasks"] == 2
    for name in ("stage1", "stage2"):
        rows = [json.loads(x) for x in (run / "data" / f"{name}.jsonl").read_text().splitlines()]
        assert sum(r["task_id"] in bird_ids for r in rows) == 2 and len(rows) == 4, name
    # Stage 4 rolled out both kinds in its one vector env.
    store = TrajectoryStore(run / "stage4")
    categories = {row[0] for row in store.query("SELECT DISTINCT category FROM trajectories")}
    assert categories & {"simple", "moderate", "challenging"}
    assert categories & {"Query", "Management", "Personalization"}
    # Both metrics before and after, side by side in the summary and the report.
    summary = json.loads((run / "summary.json").read_text())
    for key in ("before", *labels):
        assert summary[key]["metric"] == "SR" and summary[key]["n"] == eval_tasks
        assert summary[key]["generation"]["metric"] == "EX"
        assert summary[key]["generation"]["n"] == eval_tasks
    assert main(["report", str(run)]) == 0
    html = (run / "report" / "report.html").read_text()
    table = html.split("execution accuracy (generation)</h2>", 1)[1].split("</table>", 1)[0]
    for label in ("before", *labels):
        row = table.split(f"<td><code>{label}</code></td>", 1)[1].split("</tr>", 1)[0]
        assert f"{eval_tasks} (critic-mini)" in row and f"{eval_tasks} (bird-mini-eval)" in row


def test_mixed_curriculum_runs_all_four_stages_fast(tmp_path: Path) -> None:
    from birdtrain.cli import main

    assert main(["curriculum", "--preset", "smoke", "--output-dir", str(tmp_path), *_FAST]) == 0
    _check_mixed_run(tmp_path / "smoke", eval_tasks=2, labels=("after_stage4",))


@pytest.mark.slow
def test_mixed_smoke_curriculum(tmp_path: Path) -> None:
    from birdtrain.cli import main

    args = ["curriculum", "--preset", "smoke", "--output-dir", str(tmp_path), _TWO_TASK_MIX]
    assert main(args) == 0
    _check_mixed_run(tmp_path / "smoke", eval_tasks=4, labels=("after_stage2", "after_stage4"))


@pytest.mark.slow
def test_auto_mixture_chooses_by_proxy_runs(tmp_path: Path) -> None:
    from birdtrain.cli import main

    overrides = ["data.mixture_proxy_steps=1", "data.mixture_holdout=1", "data.mixture_grid=3"]
    assert main(["mixture", "--preset", "smoke", "--output-dir", str(tmp_path), *overrides]) == 0
    record = json.loads((tmp_path / "smoke" / "mixture.json").read_text())
    assert record["method"] == "proxy-sft-heldout-loss"
    assert [c["weights"] for c in record["candidates"]] == candidate_weights(
        ["gym-mini", "bird-mini-train"], 3
    )
    best = max(c["score"] for c in record["candidates"])
    assert record["chosen"] in [c["weights"] for c in record["candidates"] if c["score"] == best]
    assert all(
        set(c["heldout_loss"]) == {"gym-mini", "bird-mini-train"} for c in record["candidates"]
    )
    assert all(v > 0 for v in record["base_heldout_loss"].values())

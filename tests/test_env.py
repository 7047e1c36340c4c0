"""``BirdCritic-SQLite-v0`` from a user's side: conformance, episodes, rewards, edge cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import birdenv
from birdenv.errors import ArgumentError, TaskKindError
from birdenv.judge import judge
from birdenv.tools import format_tool_call

ROOT = Path(__file__).resolve().parents[1]
# A small database (11 MB): one task whose gold passes and whose issue SQL fails.
TASK_ID = "hospital_records_001"
# A Management task judged by a test case (a trigger), for the fraction reward.
TESTED_TASK_ID = "hospital_records_031"


def sql(text: str) -> str:
    """An ``execute_sql`` turn."""
    return format_tool_call("execute_sql", sql=text)


def submit(statements: list[str]) -> str:
    """A ``submit_solution`` turn."""
    return format_tool_call("submit_solution", sql_list=statements)


@pytest.fixture
def env() -> Iterator[gym.Env]:
    env = gym.make("BirdCritic-SQLite-v0")
    yield env
    env.close()


@pytest.mark.parametrize("env_id", birdenv.ENV_IDS)
def test_check_env_passes_without_warnings(env_id: str) -> None:
    env = gym.make(env_id)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # The unwrapped env, as Gymnasium's own tests do: check_env warns on purpose about
            # being handed the wrapper stack gymnasium.make builds.
            check_env(env.unwrapped)
    finally:
        env.close()
    assert [str(w.message) for w in caught] == []


def test_seeded_reset_is_deterministic() -> None:
    first, second = gym.make("BirdCritic-SQLite-v0"), gym.make("BirdCritic-SQLite-v0")
    try:
        drawn = set()
        for seed in range(6):
            obs_a, info_a = first.reset(seed=seed)
            obs_b, info_b = second.reset(seed=seed)
            assert (obs_a, info_a["task_id"]) == (obs_b, info_b["task_id"])
            drawn.add(info_a["task_id"])
        assert len(drawn) > 1  # the seed really picks the task
    finally:
        first.close()
        second.close()


def test_reset_on_a_named_task_shows_its_prompt(env: gym.Env) -> None:
    obs, info = env.reset(options={"task_id": TASK_ID})
    task = env.unwrapped.task
    assert info["task_id"] == TASK_ID and info["db_id"] == "hospital_records"
    assert task.query in obs and task.issue_sql[0] in obs and "CREATE TABLE" in obs
    assert info["messages"] == [{"role": "user", "content": obs}]
    with pytest.raises(KeyError, match="no_such_task"):
        env.reset(options={"task_id": "no_such_task"})


@pytest.mark.parametrize(("kind", "reward"), [("gold", 1.0), ("issue", 0.0)])
def test_scripted_episode_reward(env: gym.Env, kind: str, reward: float) -> None:
    env.reset(options={"task_id": TASK_ID})
    task = env.unwrapped.task
    obs, r, terminated, truncated, _ = env.step(sql("SELECT count(*) AS n FROM departments"))
    assert obs.startswith("status: ok\nrows: 1\n| n |") and r == 0.0
    assert not terminated and not truncated
    statements = task.sol_sql if kind == "gold" else task.issue_sql
    obs, r, terminated, truncated, info = env.step(submit(statements))
    assert (r, terminated, truncated) == (reward, True, False)
    assert info["verdict"]["status"] == ("success" if reward else "failed")
    assert obs.startswith(f"verdict: {info['verdict']['status']}")
    with pytest.raises(gym.error.ResetNeeded):
        env.step(sql("SELECT 1"))


def test_temp_table_persists_across_turns(env: gym.Env) -> None:
    env.reset(options={"task_id": TASK_ID})
    assert env.step(sql("CREATE TEMP TABLE notes AS SELECT 'kept' AS v"))[0].startswith(
        "status: ok"
    )
    env.step(sql("SELECT 1"))
    obs = env.step(sql("SELECT v FROM temp.notes"))[0]
    assert obs == "status: ok\nrows: 1\n| v |\n| kept |"
    # A new episode is a new session: the TEMP table is gone.
    env.reset(options={"task_id": TASK_ID})
    assert "no such table: temp.notes" in env.step(sql("SELECT v FROM temp.notes"))[0]


BAD_TURNS = {
    "malformed JSON": '<tool_call>{"name": "execute_sql", "arguments": {"sql": </tool_call>',
    "no call": "I think the query should use julianday().",
    "two calls": sql("SELECT 1") + sql("SELECT 2"),
    "unknown tool": format_tool_call("drop_database", sql="x"),
}


def test_bad_turns_are_error_observations_and_count(env: gym.Env) -> None:
    env.reset(options={"task_id": TASK_ID})
    limit = env.spec.max_episode_steps
    assert limit == len(BAD_TURNS) + 1  # so that the last bad turn leaves exactly one
    for why, turn in BAD_TURNS.items():
        obs, r, terminated, truncated, _ = env.step(turn)
        assert obs.startswith("status: error\nerror: "), why
        assert (r, terminated, truncated) == (0.0, False, False), why
    # Every bad turn counted: the next one is the last.
    _, r, terminated, truncated, _ = env.step(sql("SELECT 1"))
    assert (r, terminated, truncated) == (0.0, False, True)


def test_running_out_of_turns_truncates_without_verdict(env: gym.Env) -> None:
    env.reset(options={"task_id": TASK_ID})
    for turn in range(1, env.spec.max_episode_steps + 1):
        _, r, terminated, truncated, info = env.step(sql(f"SELECT {turn}"))
        assert r == 0.0 and not terminated
        assert truncated == (turn == env.spec.max_episode_steps)
    assert "verdict" not in info and env.unwrapped.verdict is None


@pytest.mark.parametrize("kind", ["gold", "issue"])
def test_fraction_reward_is_the_share_of_tests_passed(kind: str) -> None:
    env = gym.make("BirdCritic-SQLite-v0", reward="fraction")
    try:
        env.reset(options={"task_id": TESTED_TASK_ID})
        task = env.unwrapped.task
        statements = task.sol_sql if kind == "gold" else task.issue_sql
        _, r, terminated, _, info = env.step(submit(statements))
    finally:
        env.close()
    expected = judge(task, statements)
    assert terminated and r == expected.fraction
    assert r == (1.0 if kind == "gold" else 0.0)
    assert info["verdict"]["tests_total"] == len(task.test_cases)


def test_close_twice_is_harmless_and_releases_the_session() -> None:
    env = gym.make("BirdCritic-SQLite-v0")
    env.close()  # before any reset
    env = gym.make("BirdCritic-SQLite-v0")
    env.reset(options={"task_id": TASK_ID})
    pool = env.unwrapped.pool
    session_path = env.unwrapped.session.path
    open_before = pool.stats()["open_sessions"]
    assert session_path.exists()
    env.close()
    env.close()
    assert pool.stats()["open_sessions"] == open_before - 1
    assert not session_path.exists()


@pytest.mark.parametrize("env_id", birdenv.ENV_IDS)
def test_max_turns_is_refused_with_the_name_gymnasium_uses(env_id: str) -> None:
    with pytest.raises(ArgumentError, match=rf'gym.make\("{env_id}", max_episode_steps=10\)'):
        gym.make(env_id, max_turns=10)
    env = gym.make(env_id, max_episode_steps=2)
    try:
        env.reset(seed=0)
        env.step(sql("SELECT 1"))
        assert env.step(sql("SELECT 1"))[3] is True  # truncated after the second turn
    finally:
        env.close()


def test_db_dir_names_the_database_folder_of_both_envs_and_db_root_still_works(
    tmp_path: Path,
) -> None:
    critic, question = birdenv.load_tasks("critic-mini")[0], birdenv.load_tasks("bird-mini-eval")[0]
    for env_id, task in (("BirdCritic-SQLite-v0", critic), ("BirdSQL-SQLite-v0", question)):
        path = tmp_path / f"{task.kind}.jsonl"
        path.write_text(json.dumps(task.to_dict()) + "\n", encoding="utf-8")
        env = gym.make(env_id, tasks=path, db_dir=task.db_dir)
        assert env.reset()[1]["task_id"] == task.instance_id
        env.close()
        with pytest.warns(DeprecationWarning, match=r"db_root= is deprecated, use db_dir="):
            env = gym.make(env_id, tasks=path, db_root=task.db_dir)
        assert env.reset()[1]["task_id"] == task.instance_id
        env.close()


def test_an_env_refuses_tasks_of_the_other_kind() -> None:
    questions = birdenv.load_tasks("bird-mini-eval")[:2]
    with pytest.raises(TaskKindError, match="use BirdSQL-SQLite-v0"):
        gym.make("BirdCritic-SQLite-v0", tasks=questions)
    with pytest.raises(TaskKindError, match="use BirdSQL-SQLite-v0"):
        gym.make("BirdCritic-SQLite-v0", suite="bird-mini-eval")


def test_make_by_module_path_in_a_fresh_process() -> None:
    code = (
        "import sys, gymnasium\n"
        "assert 'birdenv' not in sys.modules\n"
        "env = gymnasium.make('birdenv:BirdCritic-SQLite-v0')\n"
        "obs, info = env.reset(seed=0)\n"
        "env.close()\n"
        "print(info['task_id'])\n"
    )
    done = _run_python(code)
    assert done.stdout.strip() in {t.instance_id for t in birdenv.load_tasks("critic-mini")}


@pytest.mark.parametrize(
    "imports",
    ["import birdenv\nimport gymnasium as gym", "import gymnasium as gym\nimport birdenv"],
    ids=["birdenv-first", "gymnasium-first"],
)
def test_import_birdenv_registers_in_either_order(imports: str) -> None:
    code = (
        "import sys\n"
        f"{imports}\n"
        "ids = sorted(i for i in gym.registry if i in birdenv.ENV_IDS)\n"
        "env = gym.make('BirdSQL-SQLite-v0')\n"
        "env.close()\n"
        "print(ids, gym.__spec__.loader is gym.__loader__)\n"
    )
    done = _run_python(code)
    assert done.stdout.split() == [
        "['BirdCritic-PostgreSQL-v0',",
        "'BirdCritic-SQLite-v0',",
        "'BirdSQL-SQLite-v0']",
        "True",
    ]


def test_judging_does_not_import_gymnasium() -> None:
    # The CLI and the judge's workers never make an environment: no gymnasium, no numpy.
    code = (
        "import sys, birdenv.cli, birdenv.judge\n"
        "print(sorted(m for m in ('gymnasium', 'numpy') if m in sys.modules))\n"
    )
    assert _run_python(code).stdout.strip() == "[]"


def test_judging_imports_nothing_it_does_not_use() -> None:
    # Every judging worker imports the judge: not importlib.abc (~10 ms, importlib.resources with it)
    # nor filelock (~10 ms). -S leaves out site, whose installers' finders may import them first.
    code = (
        "import sys, birdenv.cli, birdenv.judge\n"
        "print(sorted(m for m in ('importlib.abc', 'filelock') if m in sys.modules))\n"
    )
    assert _run_python(code, "-S").stdout.strip() == "[]"


def _run_python(code: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (with ``flags``) with this checkout importable; it
    must succeed."""
    done = subprocess.run(
        [sys.executable, *flags, "-c", code],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done


# Results a model could provoke that are awkward for a text space: characters outside the Basic
# Multilingual Plane, NUL, right-to-left text and bidi controls, in cells, column names, errors.
AWKWARD_SQL = {
    "emoji cell": "SELECT '🙂 ok 🚀' AS v",
    "emoji column": 'SELECT 1 AS "😀"',
    "NUL cell": "SELECT 'a' || char(0) || 'b' AS v",
    "right-to-left": "SELECT 'שלום עולם' AS v, 'مرحبا' || char(8238) || 'abc' AS w",
    "emoji in an error": 'SELECT * FROM "no_such_😀_table"',
    "NUL in the statement": "SELECT 'a\x00b'",
    "blob": "SELECT x'00ff00' AS b",
    "lone surrogate escape": "SELECT char(55357) AS v",
}


def test_observations_stay_inside_the_observation_space(env: gym.Env) -> None:
    space = env.observation_space
    obs, _ = env.reset(options={"task_id": TASK_ID})
    assert space.contains(obs)
    for why, text in AWKWARD_SQL.items():
        obs, *_ = env.step(sql(text))
        assert space.contains(obs), (why, obs)
        env.reset(options={"task_id": TASK_ID})  # keep clear of the turn limit
    # The text survives, with characters outside the space replaced by U+FFFD.
    obs, *_ = env.step(sql(AWKWARD_SQL["emoji cell"]))
    assert "| \ufffd ok \ufffd |" in obs
    obs, *_ = env.step(sql(AWKWARD_SQL["right-to-left"]))
    assert "שלום עולם" in obs and "مرحبا" in obs
    obs, *_ = env.step(sql(AWKWARD_SQL["NUL cell"]))
    assert "a\x00b" in obs
    # A submission's verdict (the awkward text inside the judge's error message) too.
    obs, *_ = env.step(submit(['SELECT "🙂" FROM nowhere']))
    assert space.contains(obs) and obs.startswith("verdict: failed")

"""The TRL adapter: the same env core under ``GRPOTrainer(environment_factory=...)``."""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path

import pytest

from birdenv.integrations.trl import (
    BirdCriticTRLEnv,
    BirdSQLTRLEnv,
    environment_factories,
    suite_dataset,
)
from birdenv.tasks import load_bird, load_tasks
from birdenv.tools import TOOL_SCHEMAS

pytest.importorskip("trl", reason="TRL is in the train extra")


def test_adapter_tools_are_the_env_tools(shop_tasks: list) -> None:
    from transformers.utils import get_json_schema

    env = BirdCriticTRLEnv(tasks=shop_tasks)
    assert [get_json_schema(env.execute_sql), get_json_schema(env.submit_solution)] == TOOL_SCHEMAS
    prompt = env.reset(task_id="shop_1", prompt=[{"role": "user", "content": ""}])
    assert "city = NULL" in prompt and "# Database Schema:" in prompt
    assert "rows: 0" not in env.execute_sql("CREATE TEMP TABLE t AS SELECT 1 AS x")
    assert env.execute_sql("SELECT x FROM t").endswith("| 1 |")
    assert env.get_reward() == 0.0
    assert env.submit_solution(["SELECT name FROM customers WHERE city IS NULL"]).startswith(
        "verdict: success"
    )
    assert env.get_reward() == 1.0
    assert "already submitted" in env.execute_sql("SELECT 1")
    env.reset(task_id="shop_1")
    assert env.get_reward() == 0.0 and "no such table" in env.execute_sql("SELECT x FROM t")


def test_text_to_sql_adapter_scores_execution_accuracy() -> None:
    question = load_bird("bird-mini-train")[0]
    env = BirdSQLTRLEnv(suite="bird-mini-train")
    prompt = env.reset(task_id=question.instance_id, prompt=[{"role": "user", "content": ""}])
    assert question.question in prompt
    assert env.execute_sql(question.SQL).startswith("status: ok")
    assert env.submit_solution(["SELECT 1"]).startswith("verdict: failed")
    assert env.get_reward() == 0.0
    env.reset(task_id=question.instance_id)
    assert env.submit_solution([question.SQL]).startswith("verdict: success")
    assert env.get_reward() == 1.0


def test_the_adapters_and_make_vec_name_the_database_folder_db_dir(tmp_path: Path) -> None:
    from birdenv.vector import make_vec

    question = load_bird("bird-mini-train")[0]
    path = tmp_path / "dev.jsonl"
    path.write_text(json.dumps(question.to_dict()) + "\n", encoding="utf-8")
    env = BirdSQLTRLEnv(tasks=path, db_dir=question.db_dir)
    assert question.question in env.reset(task_id=question.instance_id)
    with pytest.warns(DeprecationWarning, match="db_root= is deprecated, use db_dir="):
        env = BirdSQLTRLEnv(tasks=path, db_root=question.db_dir)
    assert question.question in env.reset(task_id=question.instance_id)
    for folder in ({"db_dir": question.db_dir}, {"db_root": question.db_dir}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            envs = make_vec(1, tasks=path, asynchronous=False, **folder)
        assert [str(w.message) for w in caught if w.category is DeprecationWarning] == (
            ["make_vec: db_root= is deprecated, use db_dir= (the same folder: "
             "{db_id}/{db_id}.sqlite or {db_id}/{db_id}_template.sqlite inside it)"]
            if "db_root" in folder else []
        )  # fmt: skip
        assert envs.reset(seed=0)[1]["task_id"][0] == question.instance_id
        envs.close()


def test_mixture_dataset_rows_pick_their_environment(shop_tasks: list) -> None:
    questions = load_bird("bird-mini-train")[:2]
    rows = suite_dataset([*shop_tasks[:2], *questions]).to_list()
    assert [r["environment"] for r in rows] == ["critic", "critic", "bird", "bird"]
    assert rows[2]["category"] == questions[0].difficulty
    assert len(suite_dataset(["critic-mini", "bird-mini-eval"])) == len(
        load_tasks("critic-mini")
    ) + len(load_bird("bird-mini-eval"))
    factories = environment_factories(shop_tasks, questions)
    for row in rows:  # each row's environment knows its task
        env = factories[row["environment"]]()
        assert env.reset(**row) and env.get_reward() == 0.0


def _two_grpo_steps(tmp_path: Path, dataset, environment_factory) -> list[dict]:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig, GRPOTrainer

    from birdtrain.models import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=16,
        max_steps=2,
        learning_rate=1e-4,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        max_tool_calling_iterations=2,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=str(model),
        args=args,
        train_dataset=dataset,
        environment_factory=environment_factory,
    )
    # The model is shown the two tools and nothing else of the environment (each environment of
    # a mixture brings its own two).
    assert {tool.__name__ for tool in trainer.tools} == {"execute_sql", "submit_solution"}
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2
    return logged


def _assert_rewards_are_the_verdicts(
    logged: list[dict], reported: list[tuple[object, object, float]], env_name: str
) -> None:
    """Each step's rewards (``reported``: task, submission, reward, in order) are the judge's
    verdicts on the submissions, and TRL logged their mean as the env's reward."""
    from birdenv.judge import judge

    per_step = len(reported) // len(logged)
    assert per_step >= 2 and len(reported) == per_step * len(logged)
    for step, entry in enumerate(logged):
        batch = reported[step * per_step : (step + 1) * per_step]
        verdicts = [float(judge(task, submission).passed) for task, submission, _ in batch]
        assert [reward for _, _, reward in batch] == verdicts
        assert entry[f"rewards/{env_name}/mean"] == pytest.approx(sum(verdicts) / len(verdicts))
    assert {reward for _, _, reward in reported} == {0.0, 1.0}  # passing and failing alike


@pytest.mark.stack
def test_two_grpo_steps_with_the_tiny_model(shop_tasks: list, tmp_path: Path) -> None:

    # The tiny random model never hands in a solution, so each rollout's environment hands one in
    # as it starts: the gold in every other rollout, the issue SQL in the rest. What TRL logs as
    # each step's reward must be the mean of the judge's verdicts on those submissions.
    resets: list[object] = []
    reported: list[tuple[object, list[str], float]] = []

    class HandsIn(BirdCriticTRLEnv):
        def reset(self, **row: object) -> str:
            prompt = super().reset(**row)
            task = self.env.task
            self.submission = task.sol_sql if len(resets) % 2 == 0 else task.issue_sql
            resets.append(task)
            self.submit_solution(self.submission)
            return prompt

        def get_reward(self) -> float:
            reward = super().get_reward()
            reported.append((self.env.task, self.submission, reward))
            return reward

    logged = _two_grpo_steps(
        tmp_path, suite_dataset(shop_tasks), functools.partial(HandsIn, tasks=shop_tasks)
    )
    _assert_rewards_are_the_verdicts(logged, reported, "HandsIn")


def test_two_grpo_steps_on_a_mixture(shop_tasks: list, tmp_path: Path) -> None:
    # One debugging task and one question: the two steps roll out one of each, every rollout in
    # the environment its row names (TRL's multi-environment form). Each rollout hands in the gold
    # or a wrong answer as it starts (as above); what TRL logs per environment class must be the
    # mean of the judge's verdicts on what that class's rollouts handed in.
    from birdenv.judge import score

    questions = load_bird("bird-mini-train")[:1]
    reported: dict[str, list[tuple[object, list[str], float]]] = {}
    started: dict[str, int] = {}

    def handing_in(base: type, gold, wrong) -> type:
        name = f"HandsIn{base.__name__}"

        def reset(self, **row: object) -> str:
            prompt = base.reset(self, **row)
            # A step resets its group's rollouts before it asks any for a reward: count resets.
            started[name] = started.get(name, 0) + 1
            task = self.env.task
            self.submission = gold(task) if started[name] % 2 else wrong(task)
            self.submit_solution(self.submission)
            return prompt

        def get_reward(self) -> float:
            reward = base.get_reward(self)
            reported.setdefault(name, []).append((self.env.task, self.submission, reward))
            return reward

        return type(name, (base,), {"reset": reset, "get_reward": get_reward})

    critic = handing_in(BirdCriticTRLEnv, lambda t: t.sol_sql, lambda t: t.issue_sql)
    bird = handing_in(BirdSQLTRLEnv, lambda t: [t.SQL], lambda t: ["SELECT 1"])
    logged = _two_grpo_steps(
        tmp_path,
        suite_dataset([shop_tasks[0], *questions]),
        {
            "critic": functools.partial(critic, tasks=shop_tasks[:1]),
            "bird": functools.partial(bird, tasks=questions),
        },
    )
    assert set(reported) == {critic.__name__, bird.__name__}
    rewards = []
    for name, batch in reported.items():
        # TRL logs a reward per environment class, None in a step that did not use it.
        means = [e[f"rewards/{name}/mean"] for e in logged if e[f"rewards/{name}/mean"] is not None]
        assert len(means) * 2 == len(batch), f"{name}: {means} over {batch}"
        for step, mean in enumerate(means):
            rollouts = batch[2 * step : 2 * step + 2]
            verdicts = [float(score(task, sql).passed) for task, sql, _ in rollouts]
            assert [reward for _, _, reward in rollouts] == verdicts
            assert mean == pytest.approx(sum(verdicts) / 2)
        rewards += [reward for _, _, reward in batch]
    assert sorted(set(rewards)) == [0.0, 1.0]  # the gold passes and the wrong answer fails


def test_two_grpo_steps_against_a_birdenv_serve_server(tmp_path: Path) -> None:
    # TRL over OpenEnv: a real `birdenv serve` process, and environment_factory = the wrapper over
    # OpenEnv's own client. Each rollout hands in the gold or the issue SQL as it starts (the
    # technique of the test above); the server's judge scores it over the WebSocket.
    pytest.importorskip("openenv", reason="OpenEnv's client is in the openenv extra")
    from birdenv.integrations.openenv import BirdOpenEnvTRLEnv
    from tests.test_adapters import SUITE, Server

    tasks = {task.instance_id: task for task in load_tasks(SUITE)[:2]}
    resets: list[object] = []
    reported: list[tuple[object, list[str], float]] = []

    class OverOpenEnv(BirdOpenEnvTRLEnv):
        def reset(self, **row: object) -> str:
            prompt = super().reset(**row)
            self.task = tasks[row["task_id"]]
            self.submission = self.task.sol_sql if len(resets) % 2 == 0 else self.task.issue_sql
            resets.append(self.task)
            assert self.submit_solution(self.submission).startswith("verdict: ")
            return prompt

        def get_reward(self) -> float:
            reward = super().get_reward()
            reported.append((self.task, self.submission, reward))
            return reward

    server = Server()
    try:
        logged = _two_grpo_steps(
            tmp_path,
            suite_dataset(list(tasks.values())),
            functools.partial(OverOpenEnv, base_url=server.url),
        )
        # Every episode was judged on the server and ended there: no replica lease is left.
        assert server.leases() == 0
    finally:
        server.close()
    _assert_rewards_are_the_verdicts(logged, reported, "OverOpenEnv")

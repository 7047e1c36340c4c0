"""The TRL adapter: the same env core under ``GRPOTrainer(environment_factory=...)``."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from birdenv.integrations.trl import BirdCriticTRLEnv, suite_dataset
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


def test_two_grpo_steps_with_the_tiny_model(shop_tasks: list, tmp_path: Path) -> None:
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
    )
    trainer = GRPOTrainer(
        model=str(model),
        args=args,
        train_dataset=suite_dataset(shop_tasks),
        environment_factory=functools.partial(BirdCriticTRLEnv, tasks=shop_tasks),
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2
    assert any("BirdCriticTRLEnv" in key for key in logged[0])

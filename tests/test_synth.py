"""Synthetic data of stages 1 and 2, built on real bundled tasks, and a real teacher endpoint.

The teacher is the tiny random model behind a strict OpenAI-compatible ``/v1/chat/completions``
served by an ``http.server`` thread on loopback (``chat_server`` in conftest.py; ``transformers
serve`` needs FastAPI and Uvicorn, which this environment does not install). Its text is junk: the
tests check the plumbing.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
from pathlib import Path

import gymnasium as gym
import pytest

import birdenv  # noqa: F401 - registers the environment
from birdenv.agents import SCHEMA_QUERY
from birdenv.envs.critic import render_prompt
from birdenv.judge import judge
from birdenv.tasks import load_bird, load_tasks
from birdenv.tools import TOOL_SCHEMAS, format_tool_call, parse_tool_call
from birdtrain.data import synth
from birdtrain.data.bird import (
    BIRD_TEACHER_AGENT_PROMPT,
    BIRD_TEACHER_SYSTEM_PROMPT,
    build_bird_reasoning_examples,
    build_bird_tool_trajectories,
)
from birdtrain.data.evidence import describe_changes
from birdtrain.data.reasoning import build_reasoning_examples
from birdtrain.data.tool_use import build_tool_trajectories
from birdtrain.endpoint import Teacher, TeacherError, openai_messages
from birdtrain.prompts import parse_solution, single_turn_prompt
from birdtrain.rewards import score_submission

# A Query task, an INSERT, a DELETE, a CREATE TRIGGER (which sqlglot cannot parse) and an INSERT
# whose issue version already writes the rows the fix inserts (so the fix's try collides).
TASK_IDS = [
    "bank_finance_002",
    "retail_orders_026",
    "school_district_023",
    "movie_platform_023",
    "movie_platform_025",
]


@pytest.fixture(scope="module")
def tasks() -> list:
    by_id = {t.instance_id: t for t in load_tasks("gym-mini")}
    return [by_id[i] for i in TASK_IDS]


@pytest.fixture(scope="module")
def stage1(tasks) -> tuple[list, dict]:
    stats: dict = {}
    return build_reasoning_examples(tasks, stats=stats, progress=False), stats


@pytest.fixture(scope="module")
def stage2(tasks) -> tuple[list, dict]:
    stats: dict = {}
    return build_tool_trajectories(tasks, max_turns=5, stats=stats, progress=False), stats


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from birdtrain.models import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


# -- stage 1 ------------------------------------------------------------------------------------
def test_reasoning_examples_pass_the_judge(tasks, stage1):
    examples, stats = stage1
    assert stats == {
        "tasks": 5,
        "kept": 5,
        "failed_judge": 0,
        "no_fix": 0,
        "preprocess_error": 0,
        "empty_thought": 0,
    }
    by_id = {t.instance_id: t for t in tasks}
    for example in examples:
        task = by_id[example["task_id"]]
        assert example["prompt"] == [{"role": "user", "content": single_turn_prompt(task)}]
        (answer,) = example["completion"]
        assert answer["role"] == "assistant"
        assert answer["content"].startswith("<thought>\n")
        assert "gold" not in answer["content"].lower()
        solution = parse_solution(answer["content"])
        assert solution == [s.strip() for s in task.sol_sql]
        assert judge(task, solution).passed


def test_thoughts_come_from_real_evidence(stage1):
    thoughts = {e["task_id"]: e["completion"][0]["content"] for e in stage1[0]}
    loans = thoughts["bank_finance_002"]
    # The issue query's real result (5 durations), the changed predicate, the fixed counts.
    assert "returns 5 rows (columns duration, n_ok)" in loans
    assert "in the WHERE clause" in loans and "status IS NULL OR" in loans
    assert "(12, 136)" in loans and "(12, 130)" in loans
    # The INSERT of the issue really changes nothing; the fix really inserts rows.
    assert "changes 0 rows" in thoughts["retail_orders_026"]
    assert "`'Cancelled'` should be `'cancelled'`" in thoughts["retail_orders_026"]
    # The trigger falls back to a word diff quoted from the original text.
    assert "WHEN OLD.list_id <> NEW.list_id" in thoughts["movie_platform_023"]


def test_thought_rows_sets_how_many_result_rows_a_thought_quotes(tmp_path: Path):
    """``data.thought_rows=0``: the single-turn policy never sees the SQL run, so its thoughts
    keep each result's row count and columns but quote no rows; the solutions are the same."""
    from birdtrain.config import load_config

    by_rows = {}
    for rows in (3, 0):
        cfg = load_config(
            "smoke", overrides=["data.max_train_tasks=4", f"data.thought_rows={rows}"]
        )
        synth(cfg, tmp_path / str(rows))
        lines = (tmp_path / str(rows) / "stage1.jsonl").read_text().splitlines()
        by_rows[rows] = {
            r["task_id"]: r["completion"][0]["content"] for r in map(json.loads, lines)
        }
    assert by_rows[3].keys() == by_rows[0].keys() and len(by_rows[0]) == 4
    assert any("; the first: (" in t or "; namely: (" in t for t in by_rows[3].values())
    for task_id, thought in by_rows[0].items():
        assert "; the first: " not in thought and "; namely: " not in thought, thought
        assert parse_solution(thought) == parse_solution(by_rows[3][task_id])
        assert len(thought) <= len(by_rows[3][task_id])
    # A BIRD question's offline thought follows the same setting.
    (question,) = load_bird("bird-mini-train")[:1]
    (short,) = build_bird_reasoning_examples([question], thought_rows=0)
    said = short["completion"][0]["content"]
    assert re.search(r"returns \d+\+? rows? \(columns", said) and "; the first: " not in said
    with pytest.raises(ValueError, match="thought_rows"):
        load_config("smoke", overrides=["data.thought_rows=-1"])


def test_a_solution_the_judge_rejects_is_dropped(tasks):
    broken = dataclasses.replace(tasks[0], sol_sql=list(tasks[0].issue_sql))
    stats: dict = {}
    assert build_reasoning_examples([broken], stats=stats, progress=False) == []
    assert stats["failed_judge"] == 1 and stats["kept"] == 0


def test_describe_changes_names_clauses():
    assert describe_changes(
        ["SELECT a FROM t JOIN u ON u.id = t.id"], ["SELECT a FROM t LEFT JOIN u ON u.id = t.id"]
    ) == ["in the join, `JOIN u ON u.id = t.id` should be `LEFT JOIN u ON u.id = t.id`"]
    assert describe_changes(["SELECT 1", "SELECT 2"], ["SELECT 1"]) == [
        "the statement `SELECT 2` is not needed"
    ]


# -- stage 2 ------------------------------------------------------------------------------------
def test_trajectories_replay_byte_for_byte(tasks, stage2):
    trajectories, stats = stage2
    assert stats["kept"] == 5 and stats["failed_judge"] == stats["truncated"] == 0
    env = gym.make("BirdCritic-SQLite-v0", tasks=tasks, max_episode_steps=5)
    try:
        for trajectory in trajectories:
            assert trajectory["tools"] == TOOL_SCHEMAS
            messages = trajectory["messages"]
            task = next(t for t in tasks if t.instance_id == trajectory["task_id"])
            assert messages[0] == {"role": "user", "content": render_prompt(task)}
            _, info = env.reset(options={"task_id": trajectory["task_id"]})
            for message in messages[1:]:
                if message["role"] == "assistant":
                    _, _, terminated, _, info = env.step(message["content"])
            assert terminated and info["messages"] == messages
            assert info["verdict"]["status"] == "success"
            calls = [parse_tool_call(m["content"]) for m in messages if m["role"] == "assistant"]
            assert calls[0].name == "execute_sql" and calls[-1].name == "submit_solution"
            # It looks at the tables first, then reproduces the problem.
            assert calls[0].arguments["sql"] == SCHEMA_QUERY
            assert calls[1].arguments["sql"] == task.issue_sql[0]
            assert calls[-1].arguments["sql_list"] == task.sol_sql
            # Reasoning before every call.
            assert all(not m["content"].startswith("<tool_call>") for m in messages[1::2])
    finally:
        env.close()


def test_expert_reasons_from_what_it_observed(stage2):
    by_id = {t["task_id"]: t["messages"] for t in stage2[0]}
    # The issue INSERT really changes nothing (the evidence adds the count to the observation).
    assert "changes 0 rows" in by_id["retail_orders_026"][5]["content"]
    # The problematic CREATE TRIGGER already made the trigger: the expert drops it first.
    trigger = [m["content"] for m in by_id["movie_platform_023"] if m["role"] == "assistant"]
    assert any("DROP TRIGGER IF EXISTS" in turn for turn in trigger)
    # The problematic INSERT already wrote the rows, so the fix's try collides: the expert says
    # why, with the fix's real result on a fresh copy, instead of pretending it worked.
    stats = by_id["movie_platform_025"]
    collided = [i for i, m in enumerate(stats) if "UNIQUE constraint failed" in m["content"]]
    assert collided and stats[collided[0]]["role"] == "tool"
    assert (
        "on a fresh copy, which is what gets judged, it runs but changes"
        in stats[collided[0] + 1]["content"]
    )


def test_expert_respects_the_turn_budget_and_drops_failures(tasks):
    stats: dict = {}
    short = build_tool_trajectories(tasks[:1], max_turns=2, stats=stats, progress=False)
    assert [m["role"] for m in short[0]["messages"]] == ["user", "assistant", "tool"] * 1 + [
        "assistant",
        "tool",
    ]
    broken = dataclasses.replace(tasks[0], sol_sql=list(tasks[0].issue_sql))
    rejected: list = []
    stats = {}
    assert build_tool_trajectories([broken], stats=stats, rejected=rejected, progress=False) == []
    assert stats["failed_judge"] == 1 and rejected[0]["reason"] == "failed_judge"


def test_data_formats_with_the_chat_template(stage1, stage2, tiny):
    _, tokenizer = tiny
    for trajectory in stage2[0]:
        text = tokenizer.apply_chat_template(
            trajectory["messages"], tools=trajectory["tools"], tokenize=False
        )
        assert '"name": "execute_sql"' in text and "<tool_response>" in text
        assert text.count("<tool_call>") >= len(trajectory["messages"]) // 2
    example = stage1[0][0]
    text = tokenizer.apply_chat_template(example["prompt"] + example["completion"], tokenize=False)
    assert "<thought>" in text and "</solution>" in text


# -- the teacher, for real ----------------------------------------------------------------------
def test_teacher_writes_stage1_thoughts(tasks, chat_server):
    teacher = Teacher(chat_server.url, "tiny")
    before = len(chat_server.requests)
    stats: dict = {}
    examples = build_reasoning_examples(
        tasks[:2], teacher=teacher, stats=stats, teacher_params={"max_tokens": 10}, progress=False
    )
    sent, replies = chat_server.requests[before:], chat_server.replies[before:]
    assert len(sent) == 2 and teacher.requests == 2
    for body, task, example, reply in zip(sent, tasks[:2], examples, replies, strict=True):
        assert body["model"] == "tiny" and body["max_tokens"] == 10
        user = body["messages"][-1]["content"]
        assert single_turn_prompt(task) in user
        assert all(sql in user for sql in task.sol_sql)  # the fix
        assert "- problematic statement 1: it " in user and "- syntax difference: " in user
        thought = example["completion"][0]["content"].split("</thought>")[0]
        assert reply.replace("<thought>", "").replace("</thought>", "").strip() in thought
        assert judge(task, parse_solution(example["completion"][0]["content"])).passed
    assert stats["kept"] == 2


def test_teacher_plays_stage2_episodes_and_failures_are_dropped(tasks, chat_server):
    teacher = Teacher(chat_server.url + "/v1", "tiny")
    before = len(chat_server.requests)
    stats: dict = {}
    rejected: list = []
    kept = build_tool_trajectories(
        tasks[:2],
        teacher=teacher,
        max_turns=2,
        stats=stats,
        rejected=rejected,
        teacher_params={"max_tokens": 8},
        progress=False,
    )
    # A random model never calls a tool: every episode runs out of turns and is dropped.
    assert kept == [] and stats["truncated"] == 2 and len(rejected) == 2
    sent, replies = chat_server.requests[before:], chat_server.replies[before:]
    assert len(sent) == 4
    for i, body in enumerate(sent):
        task, turn = tasks[i // 2], i % 2
        assert body["tools"] == TOOL_SCHEMAS
        assert (
            body["messages"][0]["role"] == "system"
            and task.sol_sql[0] in body["messages"][0]["content"]
        )
        # The episode so far, in OpenAI's form: turns without a tool call answered by user messages.
        assert body["messages"][1:] == openai_messages(rejected[i // 2]["messages"][: 1 + 2 * turn])
    for i, episode in enumerate(rejected):
        turns = [m["content"] for m in episode["messages"] if m["role"] == "assistant"]
        assert turns == replies[2 * i : 2 * i + 2]  # the teacher's text, byte for byte
        assert all(m["content"].startswith("status: error") for m in episode["messages"][2::2])


def test_teacher_writes_bird_thoughts(chat_server):
    questions = load_bird("bird-mini-train")[:2]
    teacher = Teacher(chat_server.url, "tiny")
    before = len(chat_server.requests)
    stats: dict = {}
    examples = build_bird_reasoning_examples(
        questions, teacher=teacher, stats=stats, teacher_params={"max_tokens": 10}
    )
    sent, replies = chat_server.requests[before:], chat_server.replies[before:]
    assert len(sent) == 2 and stats == {
        "tasks": 2,
        "kept": 2,
        "failed_judge": 0,
        "empty_thought": 0,
    }
    for body, question, example, reply in zip(sent, questions, examples, replies, strict=True):
        assert body["messages"][0] == {"role": "system", "content": BIRD_TEACHER_SYSTEM_PROMPT}
        user = body["messages"][-1]["content"]
        assert question.question in user and question.SQL in user
        answer = example["completion"][0]["content"]
        assert reply.replace("<thought>", "").replace("</thought>", "").strip() in answer
        assert score_submission(question, parse_solution(answer)).passed


def test_teacher_plays_bird_episodes_and_only_correct_ones_are_kept(chat_server):
    questions = load_bird("bird-mini-train")[:3]
    teacher = Teacher(chat_server.url + "/v1", "tiny")
    before = len(chat_server.requests)
    explore = "Look first.\n" + format_tool_call("execute_sql", sql="SELECT 1")
    right = "Answer.\n" + format_tool_call("submit_solution", sql_list=[questions[0].SQL])
    wrong = format_tool_call("submit_solution", sql_list=["SELECT 1"])
    # Question 1: explore, then the right answer; question 2: a wrong answer; question 3: the
    # tiny model's own text, which never calls a tool (out of turns).
    chat_server.scripted = [explore, right, wrong]
    stats: dict = {}
    kept = build_bird_tool_trajectories(
        questions, teacher=teacher, max_turns=2, stats=stats, teacher_params={"max_tokens": 8}
    )
    assert stats == {"tasks": 3, "kept": 1, "failed_judge": 1, "truncated": 1}
    sent = chat_server.requests[before:]
    assert len(sent) == 5 and all(body["tools"] == TOOL_SCHEMAS for body in sent)
    system = BIRD_TEACHER_AGENT_PROMPT.format(sql=questions[0].SQL)
    assert sent[0]["messages"][0] == {"role": "system", "content": system}
    (episode,) = kept
    assert episode["task_id"] == questions[0].instance_id
    assistant = [m["content"] for m in episode["messages"] if m["role"] == "assistant"]
    assert assistant == [explore, right]  # the teacher's text, byte for byte
    # The second request carried the first turn and the environment's answer to it, in OpenAI's
    # tool-calling form (the strict endpoint refuses the environment's text form).
    assert sent[1]["messages"][1:] == openai_messages(episode["messages"][:3])
    call, answer = sent[1]["messages"][2:4]
    assert call["content"] == "Look first." and call["tool_calls"][0]["function"] == {
        "name": "execute_sql",
        "arguments": '{"sql": "SELECT 1"}',
    }
    assert answer == {
        "role": "tool",
        "tool_call_id": call["tool_calls"][0]["id"],
        "content": episode["messages"][2]["content"],
    }


def test_teacher_errors_are_clear(tasks, chat_server):
    with pytest.raises(TeacherError, match=r"HTTP 404 .*no route /nowhere/v1/chat/completions"):
        Teacher(chat_server.url + "/nowhere", "tiny").chat([{"role": "user", "content": "hi"}])
    with pytest.raises(TeacherError, match="not a chat completion"):
        Teacher(chat_server.url + "/broken", "tiny").chat([{"role": "user", "content": "hi"}])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = Teacher(f"http://127.0.0.1:{port}", "tiny", timeout=5)
    with pytest.raises(TeacherError, match="unreachable"):
        build_reasoning_examples(tasks[:1], teacher=down, progress=False)


# -- the entry point ----------------------------------------------------------------------------
def test_synth_writes_both_stages(tmp_path: Path):
    from birdtrain.config import load_config

    cfg = load_config("smoke", overrides=["data.max_train_tasks=3"])
    counts = synth(cfg, tmp_path)
    assert counts["tasks"] == 3 and counts["teacher"] is None
    assert counts["stage1"] == 3 and counts["stage2"] == 3
    rows1 = [json.loads(line) for line in (tmp_path / "stage1.jsonl").read_text().splitlines()]
    rows2 = [json.loads(line) for line in (tmp_path / "stage2.jsonl").read_text().splitlines()]
    assert len(rows1) == len(rows2) == 3
    assert set(rows1[0]) == {"prompt", "completion", "task_id"}
    assert set(rows2[0]) == {"messages", "tools", "task_id"}
    # The preset's stage-4 turn budget bounds the expert's episodes.
    budget = cfg.stage4.max_turns
    assert all(sum(m["role"] == "assistant" for m in r["messages"]) <= budget for r in rows2)

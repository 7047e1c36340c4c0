"""birdenv.schema: the full and linked schema prompts, sample rows on and off, the one prompt
setting, and the environments' prompts under it."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import gymnasium as gym
import pytest

import birdenv  # noqa: F401  (registers the environments)
from birdenv.envs.bird_sql import render_prompt as bird_prompt
from birdenv.envs.critic import render_prompt as critic_prompt
from birdenv.errors import BirdEnvError, SchemaError
from birdenv.schema import PromptOptions, linked_tables, render_schema, task_schema
from birdenv.sql import fold, referenced_tables
from birdenv.tasks import Task, load_bird, load_tasks
from birdenv.vector import make_vec
from birdtrain.prompts import single_turn_prompt

LINKED = PromptOptions(schema="linked")
NAMED = PromptOptions(schema="named", sample_rows=False)
BARE = PromptOptions(schema="linked", sample_rows=False)


@pytest.fixture(scope="module")
def critic() -> list[Task]:
    return load_tasks("critic-mini")


@pytest.fixture(scope="module")
def bank(critic: list[Task]) -> Path:
    return next(t.db_path for t in critic if t.db_id == "bank_finance")


def _master(db: Path, column: str, where: str) -> list[str]:
    """One column of the schema objects SQLite lists (its own ones left out), in rowid order."""
    conn = sqlite3.connect(db)
    query = f"SELECT {column} FROM sqlite_master WHERE {where} AND name NOT LIKE 'sqlite_%'"
    return [r[0] for r in conn.execute(query + " ORDER BY rowid")]


def _tables(db: Path) -> list[str]:
    """Table names in schema order, read straight from SQLite."""
    return _master(db, "name", "type = 'table'")


def _statements(db: Path) -> list[str]:
    """The CREATE statements a schema prompt shows: tables, views, triggers (no indexes)."""
    return _master(db, "sql", "sql IS NOT NULL AND type != 'index'")


def _fk_targets(db: Path, table: str) -> set[str]:
    conn = sqlite3.connect(db)
    return {fold(r[2]) for r in conn.execute(f'PRAGMA foreign_key_list("{table}")')}


# -- render_schema ---------------------------------------------------------------------------
def test_full_schema_is_the_benchmark_form(critic: list[Task]) -> None:
    """The full schema of every critic-mini database is byte for byte the one the environments
    have always shown (its digest was taken before the linked form existed): every table's,
    view's and trigger's CREATE statement, and three rows per table."""
    digest = hashlib.sha256()
    for db in sorted({t.db_path for t in critic}):
        text = render_schema(db)
        digest.update(text.encode())
        for sql in _statements(db):
            assert f"{sql};" in text
        assert text.count("First 3 rows:") == len(_tables(db))
    assert digest.hexdigest() == "3749863872bfef13204115801fa2f8d37b3f0f18ca4effde312a9bc71d8d6f90"


def test_rows_off_prints_no_sample_block(bank: Path) -> None:
    full, bare = render_schema(bank), render_schema(bank, rows=0)
    assert "rows:" not in bare and len(bare) < len(full)
    # The same statements in the same order (tables, views, triggers), only the rows gone.
    statements = [f"{sql};" for sql in _statements(bank)]
    assert sorted(statements, key=full.index) == sorted(statements, key=bare.index)
    assert len(bare) == sum(map(len, statements)) + 2 * (len(statements) - 1)
    one = render_schema(bank, rows=1)
    assert one.count("First 1 rows:") == len(_tables(bank))


def test_table_subset_keeps_touching_views_and_triggers(bank: Path) -> None:
    text = render_schema(bank, tables=["CARDS"])  # names compare as SQLite compares them
    assert text.startswith("CREATE TABLE cards") and "CREATE TABLE accounts" not in text
    assert "CREATE VIEW" not in text and "CREATE TRIGGER" not in text
    text = render_schema(bank, tables=["transactions"])
    assert "CREATE TRIGGER trg_transactions_balance" in text
    assert "CREATE TRIGGER trg_accounts_audit" not in text


def test_unknown_table_and_bad_rows_are_clear_errors(bank: Path) -> None:
    with pytest.raises(SchemaError, match=r"no table 'nope'; its tables are accounts, .*cards"):
        render_schema(bank, tables=["cards", "nope"])
    with pytest.raises(SchemaError, match="rows must be 0 or more"):
        render_schema(bank, rows=-1)


# -- linking -------------------------------------------------------------------------------------
def test_linked_tables_are_the_named_plus_foreign_key_neighbours(bank: Path) -> None:
    for named in _tables(bank):
        expected = {fold(named)} | _fk_targets(bank, named)
        expected |= {fold(t) for t in _tables(bank) if fold(named) in _fk_targets(bank, t)}
        got = linked_tables(bank, sql=f'SELECT count(*) FROM "{named}"')
        assert {fold(t) for t in got} == expected, named
        assert got == [t for t in _tables(bank) if t in got]  # schema order


def test_named_mode_keeps_the_named_tables_alone(bank: Path) -> None:
    assert linked_tables(bank, sql="SELECT * FROM cards", neighbours=False) == ["cards"]
    sql = "SELECT * FROM loans JOIN accounts USING (account_id)"
    assert linked_tables(bank, sql=sql, neighbours=False) == ["accounts", "loans"]
    assert linked_tables(bank, sql="SELECT 1", neighbours=False) == _tables(bank)
    question = "Which card has the highest credit limit?"
    assert linked_tables(bank, text=question, neighbours=False) == ["cards"]


def test_a_view_links_the_tables_it_reads(critic: list[Task]) -> None:
    db = next(t.db_path for t in critic if t.db_id == "retail_orders")
    via_view = linked_tables(db, sql="SELECT * FROM v_customer_orders")
    conn = sqlite3.connect(db)
    query = "SELECT sql FROM sqlite_master WHERE name = 'v_customer_orders'"
    (view_sql,) = conn.execute(query).fetchone()
    direct = linked_tables(db, sql=view_sql.split(" AS ", 1)[1])
    assert via_view == direct != _tables(db)
    assert "CREATE VIEW v_customer_orders" in render_schema(db, tables=via_view)


def test_nothing_named_links_every_table(bank: Path) -> None:
    assert linked_tables(bank, sql="SELECT 1") == _tables(bank)
    assert linked_tables(bank, sql="not sql at all", text="") == _tables(bank)
    assert linked_tables(bank, text="What is the weather like?") == _tables(bank)


def test_debugging_tasks_link_every_table_their_fix_needs(critic: list[Task]) -> None:
    smaller = 0
    for task in critic:
        linked = {fold(t) for t in linked_tables(task.db_path, sql=task.issue_sql)}
        needed = {fold(t) for t in referenced_tables(task.sol_sql)} & {
            fold(t) for t in _tables(task.db_path)
        }
        assert needed <= linked, task.instance_id
        smaller += len(linked) < len(_tables(task.db_path))
    assert smaller > 0.8 * len(critic)


def test_bird_questions_link_by_question_and_evidence() -> None:
    questions = load_bird("bird-mini-eval")
    smaller = 0
    for q in questions:
        linked = {fold(t) for t in linked_tables(q.db_path, text=f"{q.question}\n{q.evidence}")}
        assert {fold(t) for t in referenced_tables(q.SQL)} <= linked, q.question
        smaller += len(linked) < len(_tables(q.db_path))
    assert smaller > 0.5 * len(questions)
    bank = questions[0].db_path
    # Words match names and columns: plurals, snake_case and camelCase split into words.
    assert "cards" in linked_tables(bank, text="Which card has the highest credit limit?")
    assert "districts" in linked_tables(bank, text="List each district name.")
    pits = linked_tables(
        next(q.db_path for q in questions if q.db_id == "formula_racing"), text="pit stops"
    )
    assert "pitStops" in pits
    # Without neighbours, the tables the gold query needs are still there for most questions.
    covered = sum(
        {fold(t) for t in referenced_tables(q.SQL)}
        <= {
            fold(t)
            for t in linked_tables(q.db_path, text=f"{q.question}\n{q.evidence}", neighbours=False)
        }
        for q in questions
    )
    assert covered > 0.9 * len(questions)


# -- PromptOptions and the prompts built with it ---------------------------------------------------
def test_prompt_options_validate() -> None:
    with pytest.raises(
        SchemaError, match="schema must be one of 'full', 'linked', 'named'; got 'short'"
    ):
        PromptOptions(schema="short")
    with pytest.raises(ValueError, match="sample_rows must be True or False"):
        PromptOptions(sample_rows="no")  # type: ignore[arg-type]
    with pytest.raises(BirdEnvError, match="unknown prompt option 'rows'"):
        PromptOptions.of({"rows": 0})
    with pytest.raises(SchemaError, match="PromptOptions or a mapping"):
        PromptOptions.of("linked")  # type: ignore[arg-type]
    assert PromptOptions.of(None) == PromptOptions() == PromptOptions.of({})
    assert PromptOptions.of({"schema": "linked", "sample_rows": False}) == BARE


def test_task_schema_modes(critic: list[Task]) -> None:
    task = critic[0]
    assert task_schema(task) == render_schema(task.db_path)
    assert task_schema(task, PromptOptions(sample_rows=False)) == render_schema(
        task.db_path, rows=0
    )
    tables = linked_tables(task.db_path, sql=task.issue_sql)
    assert task_schema(task, BARE) == render_schema(task.db_path, rows=0, tables=tables)
    with pytest.raises(TypeError, match="not a task"):
        task_schema("critic-mini", LINKED)


def test_linked_env_prompts_are_shorter_and_keep_the_issue(critic: list[Task]) -> None:
    env = gym.make("BirdCritic-SQLite-v0", prompt_options=LINKED)
    full_env = gym.make("BirdCritic-SQLite-v0")
    bare_env = gym.make(
        "BirdCritic-SQLite-v0", prompt_options={"schema": "linked", "sample_rows": False}
    )
    named_env = gym.make("BirdCritic-SQLite-v0", prompt_options=NAMED)
    try:
        for task in critic:
            options = {"task_id": task.instance_id}
            linked, _ = env.reset(options=options)
            full, _ = full_env.reset(options=options)
            bare, _ = bare_env.reset(options=options)
            named, _ = named_env.reset(options=options)
            assert full == critic_prompt(task) == critic_prompt(task, PromptOptions())
            assert linked == critic_prompt(task, LINKED) and bare == critic_prompt(task, BARE)
            assert len(named) <= len(bare) < len(linked) <= len(full)
            assert named == critic_prompt(task, NAMED)
            assert "rows:" not in bare
            for sql in task.issue_sql:
                assert f"```sql\n{sql}\n```" in linked and f"```sql\n{sql}\n```" in bare
            assert task.query in bare
    finally:
        env.close(), full_env.close(), bare_env.close(), named_env.close()


def test_bird_env_and_single_turn_prompts_share_the_setting() -> None:
    question = load_bird("bird-mini-eval")[3]
    env = gym.make("BirdSQL-SQLite-v0", prompt_options=BARE)
    try:
        prompt, _ = env.reset(options={"task_id": question.instance_id})
    finally:
        env.close()
    schema = task_schema(question, BARE)
    assert prompt == bird_prompt(question, BARE) and schema in prompt
    assert schema in single_turn_prompt(question, BARE)
    assert len(prompt) < len(bird_prompt(question))
    assert single_turn_prompt(question) == single_turn_prompt(question, PromptOptions())


def test_bad_prompt_options_fail_at_construction() -> None:
    with pytest.raises(SchemaError, match="schema must be one of"):
        gym.make("BirdCritic-SQLite-v0", prompt_options={"schema": "tiny"})


def test_make_vec_passes_prompt_options_to_every_copy(critic: list[Task]) -> None:
    task = critic[0]
    expected = critic_prompt(task, BARE)
    envs = make_vec(2, asynchronous=False, prompt_options=BARE)
    try:
        prompts, _ = envs.reset(options={"task_id": task.instance_id})
        assert list(prompts) == [expected, expected]
    finally:
        envs.close()
    question = load_bird("bird-mini-train")[0]
    mixture = {"critic-mini": 1.0, "bird-mini-train": 1.0}
    envs = make_vec(1, asynchronous=False, mixture=mixture, prompt_options=BARE)
    try:
        prompts, _ = envs.reset(options={"task_id": question.instance_id})
        assert prompts[0] == bird_prompt(question, BARE)
    finally:
        envs.close()

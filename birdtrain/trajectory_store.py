"""The trajectory store: every stage-4 rollout and every evaluation episode, queryable with DuckDB.

A single-turn answer (evaluations in ``single`` mode, the stage-3 difficulty estimate) is one row
of ``mode`` ``single``: its text in ``action``, its ``<solution>`` statements (a JSON list) in
``sql``, no tool and no observation.

Rollouts are appended as Parquet files, one row per turn, in a ``trajectories/`` folder of the part
of the run that made them (``stage4/trajectories/``, ``eval/<label>/trajectories/``), so DuckDB reads
the whole run with one ``read_parquet`` and a user can query it with SQL::

    import duckdb
    duckdb.sql("SELECT tool, count(*) FROM read_parquet('runs/smoke/**/trajectories/*.parquet') GROUP BY 1")

Columns: ``run``, ``stage``, ``step``, ``episode`` (one id per trajectory), ``task_id``,
``category``, ``turn``, ``action`` (the model's text), ``tool``, ``sql``, ``observation``,
``error`` (the tool call's or the statement's), ``verdict`` (``success``/``failed`` on the last
turn), ``reward``, ``tokens`` (generated in the turn), ``gen_seconds``, ``env_seconds``, ``created``,
``mode`` (``agent`` or ``single``; empty in stores written before it existed).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from birdenv.tools import ToolCallError, parse_tool_call
from birdtrain.errors import OutputWriteError

if TYPE_CHECKING:
    from birdtrain.rollout import Episode

__all__ = ["COLUMNS", "TrajectoryStore", "episode_rows"]

#: Column names and DuckDB types of the store.
COLUMNS: dict[str, str] = {
    "run": "VARCHAR",
    "stage": "VARCHAR",
    "step": "INTEGER",
    "episode": "VARCHAR",
    "task_id": "VARCHAR",
    "category": "VARCHAR",
    "turn": "INTEGER",
    "action": "VARCHAR",
    "tool": "VARCHAR",
    "sql": "VARCHAR",
    "observation": "VARCHAR",
    "error": "VARCHAR",
    "verdict": "VARCHAR",
    "reward": "DOUBLE",
    "tokens": "INTEGER",
    "gen_seconds": "DOUBLE",
    "env_seconds": "DOUBLE",
    "created": "DOUBLE",
    "mode": "VARCHAR",
}


def episode_rows(
    episode: Episode,
    *,
    category: str,
    run: str = "",
    stage: str = "eval",
    step: int = 0,
    mode: str = "agent",
) -> list[dict[str, Any]]:
    """One row per assistant turn of an :class:`~birdtrain.rollout.Episode`'s conversation.

    The last row carries the verdict and the reward (None when the episode broke). In ``single``
    mode the one answer is a row without a tool: ``sql`` holds its ``<solution>`` statements
    (``error`` says when there were none) and the reward is the verdict's, 1 or 0.
    """
    messages = episode.messages
    tokens = episode.turn_tokens
    seconds = episode.statement_s
    row_id = uuid.uuid4().hex[:12]
    rows = []
    turn = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        observation = messages[i + 1]["content"] if i + 1 < len(messages) else None
        tool = sql = error = None
        if mode == "single":
            sql = json.dumps(episode.pred_sqls) if episode.pred_sqls else None
            error = None if episode.pred_sqls else "no <solution> in the answer"
        else:
            try:
                call = parse_tool_call(message["content"])
                tool = call.name
                args = call.arguments
                sql = args.get("sql") if "sql" in args else json.dumps(args.get("sql_list"))
            except ToolCallError as exc:
                error = str(exc)
        if error is None and observation and observation.startswith("status: error"):
            error = observation.split("error: ", 1)[-1]
        rows.append(
            {
                "run": run,
                "stage": stage,
                "step": step,
                "episode": row_id,
                "task_id": episode.task_id,
                "category": category,
                "turn": turn,
                "action": message["content"],
                "tool": tool,
                "sql": sql,
                "observation": observation,
                "error": error,
                "verdict": None,
                "reward": None,
                "tokens": tokens[turn] if turn < len(tokens) else None,
                "gen_seconds": None,
                "env_seconds": seconds[turn] if turn < len(seconds) else None,
                "created": time.time(),
                "mode": mode,
            }
        )
        turn += 1
    if rows:
        rows[-1]["verdict"] = (episode.verdict or {}).get("status")
        reward = float(episode.passed) if mode == "single" else episode.reward
        rows[-1]["reward"] = None if episode.dropped else reward
    return rows


class TrajectoryStore:
    """Appends to ``{root}/trajectories``; reads every ``trajectories/*.parquet`` below ``root``.

    ``TrajectoryStore(run_dir)`` therefore queries a whole run: stage 4 and every evaluation.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.dir = self.root / "trajectories"

    def files(self) -> list[Path]:
        """Every Parquet file of the store, in this folder and below."""
        return sorted(self.root.rglob("trajectories/*.parquet"))

    def parts(self, prefix: str) -> list[Path]:
        """This folder's own files written under a ``name`` starting with ``prefix``."""
        return sorted(self.dir.glob(f"part-{prefix}*.parquet"))

    def append(self, rows: Iterable[dict[str, Any]], *, name: str | None = None) -> Path | None:
        """Write ``rows`` as one new Parquet file (atomically); None when there are none.

        A ``name`` makes the write repeatable: a second append under it replaces the first file,
        so a writer that may run twice (a resumed evaluation) stores its rows once.
        """
        # the train extra: imported only where used
        import duckdb

        rows = [[row.get(column) for column in COLUMNS] for row in rows]
        if not rows:
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        target = self.dir / f"part-{name or f'{time.time_ns()}-{uuid.uuid4().hex[:6]}'}.parquet"
        staging = target.with_suffix(".tmp")
        conn = duckdb.connect()
        try:
            columns = ", ".join(f'"{column}" {kind}' for column, kind in COLUMNS.items())
            conn.execute(f"CREATE TABLE t ({columns})")
            conn.executemany(f"INSERT INTO t VALUES ({', '.join('?' * len(COLUMNS))})", rows)
            conn.execute(f"COPY t TO '{staging}' (FORMAT parquet)")
        except duckdb.IOException as exc:  # a full disk: no half-written part is left behind
            with contextlib.suppress(OSError):
                staging.unlink(missing_ok=True)
            raise OutputWriteError(f"cannot write {target} ({exc})") from exc
        finally:
            conn.close()
        staging.replace(target)
        return target

    def query(self, sql: str, params: list[Any] | None = None) -> list[tuple]:
        """Run SQL where the table ``trajectories`` is the whole store."""
        # the train extra: imported only where used
        import duckdb

        conn = duckdb.connect()
        try:
            files = self.files()
            if not files:
                columns = ", ".join(f'"{n}" {k}' for n, k in COLUMNS.items())
                conn.execute(f"CREATE TABLE trajectories ({columns})")
            else:
                listed = ", ".join("'" + str(f).replace("'", "''") + "'" for f in files)
                # By name: stores written before the ``mode`` column read it as NULL.
                conn.execute(
                    f"CREATE VIEW trajectories AS SELECT * FROM read_parquet([{listed}], "
                    "union_by_name = true)"
                )
            return conn.execute(sql, params or []).fetchall()
        finally:
            conn.close()

    def show(self, task_id: str, *, limit: int = 3) -> str:
        """The most recent trajectories of a task, readably."""
        episodes = self.query(
            "SELECT episode, any_value(stage), any_value(step), max(created) AS t FROM trajectories "
            "WHERE task_id = ? GROUP BY episode ORDER BY t DESC LIMIT ?",
            [task_id, limit],
        )
        if not episodes:
            return f"no trajectories of task {task_id!r} under {self.root}"
        parts = []
        for episode, stage, step, _ in episodes:
            turns = self.query(
                "SELECT turn, action, observation, verdict, reward FROM trajectories "
                "WHERE episode = ? ORDER BY turn",
                [episode],
            )
            lines = [f"== {task_id}  episode {episode}  ({stage}, step {step})"]
            for turn, action, observation, verdict, reward in turns:
                lines.append(f"-- turn {turn} [assistant]\n{action}")
                if observation is not None:
                    lines.append(f"-- turn {turn} [tool]\n{observation}")
                if verdict is not None:
                    lines.append(f"== verdict: {verdict}, reward {reward}")
            parts.append("\n".join(lines))
        return "\n\n".join(parts)

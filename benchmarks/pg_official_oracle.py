"""Agreement and speed of ``birdenv evaluate`` against the official BIRD-CRITIC PostgreSQL wrapper.

The official evaluator (``bird-bench/BIRD-CRITIC-1``, MIT) is not part of this project. Point this
script at a copy of its ``evaluation/src`` whose ``postgresql_utils.py`` has its host and user set
to this project's cluster (the socket directory ``birdenv doctor`` names and the user
``birdenv``; the only edit), and at a Python with ``psycopg2`` and ``tqdm``::

    python benchmarks/pg_official_oracle.py --official-src SRC --official-python PY \\
        [--jobs 4] [--limit 500] [--values] [--keep DIR] [--skip-official FILE]

It makes the predictions (:func:`shaped_predictions`: four per task of critic-mini-pg and
gym-mini-pg, in the shapes models submit: gold and issue SQL, comments before, inside and after
statements, several statements in one string, ``DateStyle`` and time zones, ``'infinity'``,
three-part names, ``ALTER DATABASE``, a superuser's settings, data-modifying ``WITH`` over the row
cap, statements that fail when ``ex_base`` runs the prediction a second time; ``--values``: one
per Management and Personalization task ending with values psycopg2 reads its own way), makes
the six databases the official evaluator expects on the project's cluster (``{db_id}_template`` and
``{db_id}``, from the project's templates), then judges the same rows

* with the official wrapper, unchanged: ``wrapper_evaluation_postgresql.py --num_threads N
  --mode pred --report false`` (one database per ``db_id`` under a lock, the official reset and a
  one-second pause after each instance);
* with ``birdenv evaluate INPUT --db-dir D --out OUT --jobs N`` in a process of its own, sampling
  the disk its clones take (the sum of their ``pg_database_size``) every 0.2 s, and counting the
  clones still on the server when its verdicts are complete (the backlog it must drop before it
  exits) and the seconds from then to its exit.

It prints both wall times, predictions per second, agreement and every disagreement; ``--keep``
keeps the rows and both sides' verdicts (the official ones are what
``tests/fixtures/pg_official_verdicts_shapes.jsonl`` holds).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from birdenv.judge.postgres import TaskDatabases
from birdenv.postgres import DatabasePool, find_bindir
from birdenv.tasks import Task, load_tasks

Shape = Callable[[Task], list[str] | None]


def _three_part(task: Task) -> list[str] | None:
    """The gold with every table named ``db_id.public.table`` (sqlglot), where it parses."""
    import sqlglot
    from sqlglot import exp

    logging.getLogger("sqlglot").setLevel(logging.ERROR)  # its notes on PL/pgSQL bodies

    out = []
    for sql in task.sol_sql:
        try:
            tree = sqlglot.parse_one(sql, read="postgres")
        except sqlglot.errors.ParseError:
            return None
        ctes = {c.alias_or_name for c in tree.find_all(exp.CTE)}
        changed = False
        for table in tree.find_all(exp.Table):
            if not table.args.get("db") and table.name and table.name not in ctes:
                table.set("db", exp.to_identifier("public"))
                table.set("catalog", exp.to_identifier(task.db_id))
                changed = True
        if not changed:
            return None
        out.append(tree.sql(dialect="postgres"))
    return out


def _with_update(task: Task) -> list[str] | None:
    """A data-modifying ``WITH`` returning more rows than the official cap (10,000), then gold."""
    return [
        "CREATE TABLE IF NOT EXISTS audit_marks AS "
        "SELECT g AS id, false AS seen FROM generate_series(1, 10001) g",
        "WITH u AS (UPDATE audit_marks SET seen = true RETURNING id) SELECT id FROM u",
        *task.sol_sql,
    ]


#: Name -> how a prediction of that shape is made from a task (None: the shape does not apply).
SHAPES: dict[str, Shape] = {
    "gold": lambda t: list(t.sol_sql),
    "issue": lambda t: list(t.issue_sql) or None,
    "comment-first": lambda t: ["-- the corrected query", *t.sol_sql],
    "comment-last": lambda t: [*t.sol_sql, "-- done"],
    "empty-last": lambda t: [*t.sol_sql, ";"],
    "block-comment": lambda t: [f"/* fixed */ {t.sol_sql[0]}", *t.sol_sql[1:]],
    "line-comment-inside": lambda t: [f"-- fix:\n{t.sol_sql[0]}", *t.sol_sql[1:]],
    "one-string": lambda t: ["; ".join(s.rstrip().rstrip(";") for s in t.sol_sql) + ";"],
    "one-string-commented": lambda t: [
        "; ".join(s.rstrip().rstrip(";") for s in t.sol_sql) + "; -- checked"
    ],
    "datestyle-sql": lambda t: ["SET datestyle = 'SQL, DMY'", *t.sol_sql],
    "datestyle-iso": lambda t: ["SET datestyle = 'ISO, DMY'", *t.sol_sql],
    "timezone-interval": lambda t: ["SET TIME ZONE INTERVAL '+09:00' HOUR TO MINUTE", *t.sol_sql],
    "timezone-named": lambda t: ["SET TIME ZONE 'America/New_York'", *t.sol_sql],
    "infinity-date": lambda t: [*t.sol_sql, "SELECT 'infinity'::date AS open_end"],
    "infinity-timestamp": lambda t: [
        *t.sol_sql,
        "SELECT '-infinity'::timestamp, 'infinity'::timestamptz",
    ],
    "three-part-names": _three_part,
    "catalog-name": lambda t: [
        f"SELECT count(*) FROM information_schema.tables WHERE table_catalog = '{t.db_id}'",
        *t.sol_sql,
    ],
    "alter-database": lambda t: [f"ALTER DATABASE {t.db_id} SET work_mem = '64MB'", *t.sol_sql],
    "superuser-setting": lambda t: ["SET session_replication_role = replica", *t.sol_sql],
    "with-update-over-cap": _with_update,
    "create-twice": lambda t: ["CREATE TABLE scratch_notes (note text)", *t.sol_sql],
    "create-if-not-exists": lambda t: [
        "CREATE TABLE IF NOT EXISTS scratch_notes (note text)",
        *t.sol_sql,
    ],
    "begin-commit": lambda t: ["BEGIN", *t.sol_sql, "COMMIT"],
}


#: Shapes that end with values psycopg2 reads its own way, for the tasks whose tests check the
#: prediction's effects rather than its rows (Management, Personalization): the prediction's
#: last statement then decides alone whether it runs.
VALUE_SHAPES: dict[str, Shape] = {
    "datestyle-date-read": lambda t: [
        "SET datestyle = 'SQL, DMY'",
        *t.sol_sql,
        "SELECT DATE '2024-01-02' AS day",
    ],
    "intervalstyle-read": lambda t: [
        "SET intervalstyle = 'iso_8601'",
        *t.sol_sql,
        "SELECT interval '1 day 2 hours' AS span",
    ],
    "time-2400-read": lambda t: [*t.sol_sql, "SELECT time '24:00' AS midnight"],
    "timezone-interval-read": lambda t: [
        "SET TIME ZONE INTERVAL '+09:00' HOUR TO MINUTE",
        *t.sol_sql,
        "SELECT timestamptz '2024-01-01 20:00+00' AS at",
    ],
}


def value_predictions(tasks: list[Task]) -> list[dict[str, Any]]:
    """One prediction of a :data:`VALUE_SHAPES` shape per Management and Personalization task,
    the shapes taken in turn."""
    names = list(VALUE_SHAPES)
    chosen = [t for t in tasks if t.category in ("Management", "Personalization") and t.sol_sql]
    return [
        {"instance_id": t.instance_id, "prediction": names[k % len(names)],
         "pred_sqls": VALUE_SHAPES[names[k % len(names)]](t)}
        for k, t in enumerate(chosen)
    ]  # fmt: skip


def shaped_predictions(tasks: list[Task], per_task: int = 4) -> list[dict[str, Any]]:
    """``per_task`` predictions of each task, the shapes taken in turn (deterministic): rows of
    ``instance_id`` (the task's), ``prediction`` (the shape) and ``pred_sqls``."""
    names = list(SHAPES)
    rows, turn = [], 0
    for task in tasks:
        made = 0
        tried = 0
        while made < per_task and tried < len(names):
            name = names[turn % len(names)]
            turn += 1
            tried += 1
            sqls = SHAPES[name](task) if task.sol_sql else None
            if sqls:
                rows.append(
                    {"instance_id": task.instance_id, "prediction": name, "pred_sqls": sqls}
                )
                made += 1
    return rows


def official_databases(pool: DatabasePool, tasks: list[Task], *, make: bool = True) -> None:
    """``{db_id}_template`` and ``{db_id}`` on the pool's server, copies of the project's
    templates, owned by the administrator (the official evaluator connects as a superuser);
    ``make=False`` drops them (the project's judge then names its clones ``{db_id}``)."""
    databases = TaskDatabases(pool)
    with pool.server.admin() as admin:
        for db_id in sorted({t.db_id for t in tasks}):
            template = databases.template_for(next(t for t in tasks if t.db_id == db_id))
            for name in (db_id, f"{db_id}_template"):
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            if make:
                for name, source in ((f"{db_id}_template", template), (db_id, f"{db_id}_template")):
                    admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{source}"')


def _input_rows(tasks: list[Task], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_id = {t.instance_id: t for t in tasks}
    return [
        {**by_id[r["instance_id"]].to_dict(), "instance_id": f"{r['instance_id']}#{k}",
         "pred_sqls": r["pred_sqls"]}
        for k, r in enumerate(rows)
    ]  # fmt: skip


def run_official(src: Path, python: str, input_path: Path, jobs: int) -> tuple[list[dict], float]:
    """The official wrapper on ``input_path``; its rows and wall time."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(python).parent), str(find_bindir()), env["PATH"]])
    started = time.perf_counter()
    subprocess.run(
        [python, "wrapper_evaluation_postgresql.py", "--jsonl_file", str(input_path),
         "--num_threads", str(jobs), "--mode", "pred", "--report", "false"],
        cwd=src, env=env, check=True, capture_output=True,
    )  # fmt: skip
    wall = time.perf_counter() - started
    out = input_path.with_name(input_path.stem + "_output_with_status.jsonl")
    return [json.loads(line) for line in out.read_text().splitlines() if line], wall


def run_ours(
    pool: DatabasePool, input_path: Path, db_dir: Path, jobs: int, out: Path
) -> dict[str, Any]:
    """``birdenv evaluate`` on ``input_path``: wall time to complete verdicts and to exit, peak
    disk of its clones, clones left on the server when its verdicts were complete."""
    want = len(input_path.read_text().splitlines())
    command = [
        sys.executable, "-c", "import sys; from birdenv.cli import main; sys.exit(main())",
        "evaluate", str(input_path), "--db-dir", str(db_dir), "--out", str(out),
        "--jobs", str(jobs), "--no-cache",
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pattern = f"bc\\_%\\_{proc.pid}\\_%"
    peak, done_at, backlog = 0, None, None
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr or []), daemon=True)
    reader.start()
    with pool.server.admin() as admin:
        while proc.poll() is None:
            size, count = admin.execute(
                "SELECT coalesce(sum(pg_database_size(oid)), 0), count(*) FROM pg_database "
                "WHERE datname LIKE %s",
                (pattern,),
            ).fetchone()
            peak = max(peak, int(size))
            if done_at is None and out.is_file() and len(out.read_text().splitlines()) >= want:
                done_at, backlog = time.perf_counter() - started, int(count)
            time.sleep(0.2)
    exited = time.perf_counter() - started
    reader.join()
    if proc.returncode != 0:
        raise SystemExit(f"birdenv evaluate failed ({proc.returncode}):\n{''.join(stderr)[-4000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines() if line]
    return {
        "rows": rows,
        "verdicts_s": done_at if done_at is not None else exited,
        "exit_s": exited,
        "peak_disk_bytes": peak,
        "backlog_at_verdicts": backlog,
    }


def main(argv: list[str] | None = None) -> int:
    """Run both sides on the shaped predictions; print speed, disk, backlog and agreement."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official-src", type=Path, required=True)
    parser.add_argument("--official-python", required=True, help="a Python with psycopg2, tqdm")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument("--keep", type=Path, help="keep rows and verdicts in this folder")
    parser.add_argument("--skip-official", type=Path, help="official verdicts of an earlier run")
    parser.add_argument(
        "--values", action="store_true", help="the value-reading set (VALUE_SHAPES) instead"
    )
    args = parser.parse_args(argv)

    tasks = load_tasks("critic-mini-pg") + load_tasks("gym-mini-pg")
    rows = (value_predictions(tasks) if args.values else shaped_predictions(tasks))[: args.limit]
    work = Path(tempfile.mkdtemp(prefix="pg_official_oracle_"))
    try:
        input_path = work / "input.jsonl"
        inputs = _input_rows(tasks, rows)
        input_path.write_text("".join(json.dumps(r) + "\n" for r in inputs))
        with DatabasePool(ready=0) as pool:
            if not args.skip_official:
                official_databases(pool, tasks)
            if args.skip_official:
                official = [json.loads(x) for x in args.skip_official.read_text().splitlines()]
                t_official = float("nan")
            else:
                official, t_official = run_official(
                    args.official_src, args.official_python, input_path, args.jobs
                )
            official_databases(pool, tasks, make=False)
            ours = run_ours(pool, input_path, Path(tasks[0].db_dir), args.jobs, work / "ours.jsonl")
        by_id = {r["instance_id"]: r for r in ours["rows"]}
        disagree = [(o, by_id.get(o["instance_id"], {})) for o in official]
        disagree = [(o, m) for o, m in disagree if m.get("status") != o["status"]]
        n = len(official)
        print(
            f"{n} predictions; official wrapper {t_official:.1f} s "
            f"({n / t_official:.2f}/s); birdenv evaluate verdicts {ours['verdicts_s']:.1f} s "
            f"({n / ours['verdicts_s']:.2f}/s), exit {ours['exit_s']:.1f} s; peak disk of its "
            f"clones {ours['peak_disk_bytes'] / 2**20:.0f} MiB; clones left when the verdicts "
            f"were complete: {ours['backlog_at_verdicts']}; agree {n - len(disagree)}/{n}"
        )
        for o, m in disagree:
            shape = rows[int(o["instance_id"].rsplit("#", 1)[1])]["prediction"]
            print(
                f"  DISAGREE {o['instance_id']} ({shape}): official={o['status']} "
                f"ours={m.get('status')} ({m.get('phase')}: {str(m.get('error'))[:160]!r})"
            )
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            labelled = [{**r, "official": o["status"]} for r, o in zip(rows, official, strict=True)]
            (args.keep / "shapes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labelled))
            (args.keep / "official.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in official)
            )
            shutil.copy2(work / "ours.jsonl", args.keep / "ours.jsonl")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if disagree else 0


if __name__ == "__main__":
    raise SystemExit(main())

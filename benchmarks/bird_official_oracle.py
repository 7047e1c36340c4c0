"""BIRD execution accuracy (EX): ``birdenv`` against BIRD's own evaluation scripts.

BIRD's evaluators are not part of this project. Point this script at folders holding them:

* ``bird-bench/mini_dev``: ``evaluation/evaluation_ex.py`` with ``evaluation_utils.py``;
* ``AlibabaResearch/DAMO-ConvAI``: ``bird/llm/src/evaluation.py`` (the BIRD dev evaluator).

They import ``func_timeout`` (and ``psycopg2``/``pymysql`` at module level), so run them with a
Python that has those (``--official-python``; e.g. a venv with ``pip install func_timeout
psycopg2-binary pymysql``)::

    python benchmarks/bird_official_oracle.py pairs \\
        --official-src /path/to/mini_dev/evaluation --official-src /path/to/bird/llm/src \\
        --official-python /path/to/venv/bin/python [--write]

    python benchmarks/bird_official_oracle.py suite --official-src /path/to/mini_dev/evaluation \\
        --official-python /path/to/venv/bin/python [--suite bird-mini-eval]

``pairs`` judges every pair of ``tests/fixtures/bird_ex/pairs.jsonl`` (over the ``shop`` database
of ``tests/conftest.py``) with each official script's own ``execute_model`` (prediction, gold,
database file, index, time limit), one fresh copy of the database and one process per pair, and
with :func:`birdenv.judge.ex.execution_accuracy`. It prints every pair on which the scripts disagree
with each other, with the fixture's ``official`` field, or with ours (pairs whose ``ours`` field
records a deliberate difference are listed apart). ``--write`` stores the first script's verdicts
in the fixture's ``official`` field. A pair's ``timeout`` (seconds) is the time limit on both
sides; the default is the official 30 s.

``suite`` runs the whole official ``evaluation_ex.py`` (the mini-dev command line: a prediction
JSON object, a gold ``.sql`` file, a difficulty JSONL) and ``birdenv evaluate`` on prediction sets
for a bundled suite (the gold itself, a wrong column added to every gold, the gold inside an
aliased derived table, the hand-written rewrites of ``tests/fixtures/bird_ex/rewrites.jsonl``, a
mixture) and compares the EX table per difficulty, then each question's verdict against the
official ``execute_model`` on that question.

Exit status 1 when anything disagrees (deliberate differences excepted).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ROOT / "tests" / "fixtures" / "bird_ex" / "pairs.jsonl"
OFFICIAL_TIME_LIMIT = 30.0  # ``meta_time_out`` in both official run scripts

# Runs in the official scripts' Python: imports the official module and calls its
# ``execute_model`` on one pair, on a private copy of the database, and prints the result.
_DRIVER = r"""
import inspect, json, os, shutil, sys
src, module, db, work = sys.argv[1:5]
sys.path.insert(0, src)
mod = __import__(module)
pair = json.loads(sys.stdin.read())
copy = os.path.join(work, "db.sqlite")
shutil.copyfile(db, copy)
args = [pair["pred"], pair["gold"], copy, 0, pair["time_limit"]]
if "sql_dialect" in inspect.signature(mod.execute_model).parameters:
    args.append("SQLite")
result = mod.execute_model(*args)
sys.stdout.write("\nRESULT " + json.dumps(result["res"]) + "\n")
sys.stdout.flush()
os._exit(0)  # a timed-out query may still run in a thread: do not wait for it
"""


def official_module(src: Path) -> tuple[str, str]:
    """``(module, label)`` of the official evaluator in ``src``."""
    if (src / "evaluation_ex.py").is_file():
        return "evaluation_ex", "mini_dev"
    if (src / "evaluation.py").is_file():
        return "evaluation", "dev"
    raise SystemExit(f"{src}: neither evaluation_ex.py (mini_dev) nor evaluation.py (BIRD dev)")


def official_pair(
    python: str, src: Path, module: str, db: Path, pair: dict[str, Any], work: Path
) -> bool:
    """The official script's EX (``res``) for one pair, in its own process."""
    work.mkdir(parents=True)
    payload = {**pair, "time_limit": pair.get("timeout", OFFICIAL_TIME_LIMIT)}
    proc = subprocess.run(
        [python, "-c", _DRIVER, str(src), module, str(db), str(work)],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=payload["time_limit"] + 120,
    )
    found = re.search(r"^RESULT (\d)$", proc.stdout, re.MULTILINE)
    if proc.returncode or not found:
        raise SystemExit(f"{pair['id']}: the official driver failed:\n{proc.stdout}\n{proc.stderr}")
    return found.group(1) == "1"


def cmd_pairs(args: argparse.Namespace) -> int:
    from birdenv.judge.ex import execution_accuracy
    from birdenv.replicas.pool import ReplicaPool
    from birdenv.tasks import BirdTask

    sys.path.insert(0, str(ROOT))  # the shop database is the tests' own
    from tests.conftest import build_shop

    rows = [json.loads(line) for line in PAIRS.read_text().splitlines() if line.strip()]
    sources = [(Path(s), *official_module(Path(s))) for s in args.official_src]
    problems: list[str] = []
    deliberate: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bird-oracle-") as tmp:
        work = Path(tmp)
        db = build_shop(work / "dbs")
        started = time.perf_counter()
        official: dict[str, dict[str, bool]] = {label: {} for _, _, label in sources}
        for index, row in enumerate(rows):
            for src, module, label in sources:
                official[label][row["id"]] = official_pair(
                    args.official_python, src, module, db, row, work / label / str(index)
                )
        official_s = time.perf_counter() - started
        started = time.perf_counter()
        with ReplicaPool(root=work / "replicas") as pool:
            ours = {}
            for row in rows:
                task = BirdTask(
                    question_id=1, db_id="shop", question="?", SQL=row["gold"], db_dir=work / "dbs"
                )
                verdict = execution_accuracy(
                    task,
                    row["pred"],
                    pool=pool,
                    statement_timeout=row.get("timeout", OFFICIAL_TIME_LIMIT),
                )
                ours[row["id"]] = verdict.correct
        ours_s = time.perf_counter() - started
    first = sources[0][2]
    for row in rows:
        verdicts = {label: official[label][row["id"]] for _, _, label in sources}
        if len(set(verdicts.values())) > 1:
            problems.append(f"{row['id']}: the official scripts disagree: {verdicts}")
        reference = verdicts[first]
        if not args.write and row.get("official") != reference:
            problems.append(
                f"{row['id']}: fixture says official={row.get('official')}, {first} says {reference}"
            )
        line = f"{row['id']}: official {reference}, ours {ours[row['id']]}"
        if "ours" in row:
            if ours[row["id"]] != row["ours"]:
                problems.append(f"{line}; the fixture records ours={row['ours']}")
            deliberate.append(f"{line} (deliberate: {row['why']})")
        elif ours[row["id"]] != reference:
            problems.append(f"{line} ({row['note']})")
        row["official"] = reference
    if args.write:
        PAIRS.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        print(f"wrote the {first} verdicts into {PAIRS}")
    agree = sum(ours[r["id"]] == official[first][r["id"]] for r in rows)
    print(
        f"{len(rows)} pairs; official ({', '.join(label for *_, label in sources)}) in "
        f"{official_s:.1f} s, ours in {ours_s:.1f} s; ours agrees with {first} on {agree}/{len(rows)}"
    )
    for line in deliberate:
        print(f"  {line}")
    for line in problems:
        print(f"DISAGREE {line}")
    return 1 if problems else 0


# -- the whole command line on a bundled suite ------------------------------------------------
_TABLE = re.compile(r"^EX\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", re.MULTILINE)


# Runs in the official scripts' Python: ``execute_model`` on many read-only pairs in one process
# (the suite's prediction sets do not write, so the databases are shared).
_BATCH_DRIVER = r"""
import inspect, json, sys
src = sys.argv[1]
sys.path.insert(0, src)
mod = __import__("evaluation_ex")
out = []
for pred, gold, db in json.loads(sys.stdin.read()):
    out.append(mod.execute_model(pred, gold, db, len(out), 30.0, "SQLite")["res"])
sys.stdout.write("\nRESULT " + json.dumps(out) + "\n")
"""
REWRITES = ROOT / "tests" / "fixtures" / "bird_ex" / "rewrites.jsonl"


def one_line(sql: str) -> str:
    """The official gold file holds one ``SQL<TAB>db_id`` a line: no newlines or tabs inside."""
    return re.sub(r"[\r\n\t]+", " ", sql).strip()


def prediction_sets(tasks: list[Any]) -> dict[str, dict[int, str]]:
    """Prediction sets: the gold; a wrong extra column; the gold under an alias; the hand-written
    rewrites of ``tests/fixtures/bird_ex/rewrites.jsonl`` (gold elsewhere); a mixture of the
    first three by question."""
    handwritten = {
        row["question_id"]: row["pred_sql"]
        for row in map(json.loads, REWRITES.read_text().splitlines())
    }
    sets: dict[str, dict[int, str]] = {
        name: {} for name in ("gold", "wrong_column", "rewrite", "handwritten", "mixed")
    }
    for index, task in enumerate(tasks):
        gold = task.SQL.strip().rstrip(";")
        qid = task.question_id
        sets["gold"][qid] = task.SQL
        sets["wrong_column"][qid] = f"SELECT *, 'x' AS wrong FROM ({gold})"
        sets["rewrite"][qid] = f"SELECT q_alias.* FROM ({gold}) AS q_alias"
        sets["handwritten"][qid] = handwritten.get(qid, task.SQL)
        sets["mixed"][qid] = (sets["gold"], sets["wrong_column"], sets["rewrite"])[index % 3][qid]
    return sets


def cmd_suite(args: argparse.Namespace) -> int:
    from birdenv.tasks import load_bird

    src = Path(args.official_src[0])
    if official_module(src)[1] != "mini_dev":
        raise SystemExit("suite needs the mini_dev evaluation folder (evaluation_ex.py)")
    tasks = load_bird(args.suite)
    failures = 0
    with tempfile.TemporaryDirectory(prefix="bird-oracle-suite-") as tmp:
        work = Path(tmp)
        # The official layout {db_root}/{db_id}/{db_id}.sqlite, on copies of the bundled bases.
        db_root = work / "dbs"
        for db_id, task in {t.db_id: t for t in tasks}.items():
            (db_root / db_id).mkdir(parents=True)
            shutil.copyfile(task.db_path, db_root / db_id / f"{db_id}.sqlite")
        gold_sql = work / "gold.sql"
        gold_sql.write_text("".join(f"{one_line(t.SQL)}\t{t.db_id}\n" for t in tasks))
        diff = work / "diff.jsonl"
        diff.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in tasks))
        for name, preds in prediction_sets(tasks).items():
            pred_file = work / f"{name}.json"
            by_id = {t.question_id: t for t in tasks}
            pred_file.write_text(
                json.dumps(
                    {
                        str(qid): f"{one_line(sql)}\t----- bird -----\t{by_id[qid].db_id}"
                        for qid, sql in preds.items()
                    }
                )
            )
            started = time.perf_counter()
            proc = subprocess.run(
                [
                    args.official_python,
                    "-u",
                    "evaluation_ex.py",
                    "--db_root_path",
                    f"{db_root}/",
                    "--predicted_sql_path",
                    str(pred_file),
                    "--ground_truth_path",
                    str(gold_sql),
                    "--diff_json_path",
                    str(diff),
                    "--num_cpus",
                    str(args.jobs),
                    "--meta_time_out",
                    str(OFFICIAL_TIME_LIMIT),
                    "--output_log_path",
                    str(work / f"{name}.log"),
                ],
                cwd=src,
                capture_output=True,
                text=True,
            )
            official_s = time.perf_counter() - started
            found = _TABLE.search(proc.stdout)
            if proc.returncode or not found:
                raise SystemExit(f"the official script failed:\n{proc.stdout}\n{proc.stderr}")
            official = [float(x) for x in found.groups()]
            started = time.perf_counter()
            out = work / f"{name}.verdicts.jsonl"
            ours_proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "birdenv",
                    "evaluate",
                    str(pred_file),
                    "--suite",
                    args.suite,
                    "--out",
                    str(out),
                    "--jobs",
                    str(args.jobs),
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            ours_s = time.perf_counter() - started
            if ours_proc.returncode:
                raise SystemExit(
                    f"birdenv evaluate failed:\n{ours_proc.stdout}\n{ours_proc.stderr}"
                )
            ours = []
            for level in ("simple", "moderate", "challenging", "overall"):
                match = re.search(
                    rf"^{level}\s+\d+\s+\d+\s+([\d.]+)", ours_proc.stdout, re.MULTILINE
                )
                ours.append(float(match.group(1)) if match else float("nan"))
            same = all(abs(a - b) < 0.005 for a, b in zip(official, ours, strict=True))
            # Per question: the official execute_model on each pair, against our verdict rows.
            pairs = [
                [
                    one_line(preds[t.question_id]),
                    one_line(t.SQL),
                    str(db_root / t.db_id / f"{t.db_id}.sqlite"),
                ]
                for t in tasks
            ]
            batch = subprocess.run(
                [args.official_python, "-c", _BATCH_DRIVER, str(src)],
                input=json.dumps(pairs),
                capture_output=True,
                text=True,
            )
            found = re.search(r"^RESULT (.*)$", batch.stdout, re.MULTILINE)
            if batch.returncode or not found:
                raise SystemExit(f"the official driver failed:\n{batch.stdout}\n{batch.stderr}")
            per_question = json.loads(found.group(1))
            verdicts = {
                row["question_id"]: row["correct"]
                for row in map(json.loads, out.read_text().splitlines())
            }
            differ = [
                t.question_id
                for t, res in zip(tasks, per_question, strict=True)
                if verdicts[t.question_id] != bool(res)
            ]
            failures += not same or bool(differ)
            print(
                f"{name:<13} EX simple/moderate/challenging/total: official {official} in "
                f"{official_s:.1f} s, ours {ours} in {ours_s:.1f} s: {'agree' if same else 'DISAGREE'}; "
                f"per question {len(tasks) - len(differ)}/{len(tasks)} agree"
                + (f" (differ: {differ})" if differ else "")
            )
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, func in (("pairs", cmd_pairs), ("suite", cmd_suite)):
        sub = commands.add_parser(name)
        sub.add_argument(
            "--official-src",
            action="append",
            required=True,
            help="folder holding evaluation_ex.py (mini_dev) or evaluation.py (BIRD dev); repeatable",
        )
        sub.add_argument(
            "--official-python",
            default=sys.executable,
            help="a Python with func_timeout, psycopg2 and pymysql",
        )
        sub.set_defaults(func=func)
    commands.choices["pairs"].add_argument(
        "--write", action="store_true", help="store the verdicts in the fixture's 'official' field"
    )
    commands.choices["suite"].add_argument("--suite", default="bird-mini-eval")
    commands.choices["suite"].add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

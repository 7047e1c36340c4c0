"""Agreement and speed of ``birdenv evaluate`` against the official BIRD-CRITIC-SQLite evaluator.

The official evaluator (``bird-bench/BIRD-CRITIC-1``, MIT) is not part of this project: point this
script at a folder holding its SQLite scripts (``single_instance_eval_sqlite.py`` with
``sqlite_utils.py``, ``sqlite_test_utils.py``, ``logger.py`` and the ``utils.py`` that the
current official tree lacks; restore it from the commit that deleted it)::

    python benchmarks/official_oracle.py --official-src /path/to/evaluation/src \\
        [--suite critic-mini | --tasks T.jsonl --db-dir D] [--predictions P.jsonl] [--jobs N]

(or set ``BIRD_CRITIC_OFFICIAL_SRC``). For every task it builds two prediction sets, the gold
(``pred_sqls = sol_sql``) and the issue SQL (``pred_sqls = issue_sql``), plus ``--predictions``
if given (rows of ``instance_id`` + ``pred_sqls``). Each set is judged twice on identical input:

* official: one ``single_instance_eval_sqlite.py --mode pred --logging false`` subprocess per
  instance, exactly as the official wrapper starts it (180 s limit, ``EPHEMERAL_DB_PATH``), but
  each on its own fresh copy of the template, ``--jobs`` at a time (the wrapper's own copy choice
  lets concurrent threads share a copy);
* ours: ``birdenv evaluate INPUT --db-dir D --out OUT --jobs N``, twice: with ``--no-cache``
  (every issue phase runs) and as users run it (issue-phase outcomes remembered by an earlier
  run or by ``birdenv data validate`` are reused; the line before that row says how many were).

It prints, per set, how many instances each side passed, how many statuses agree, every
disagreement, and both wall times. Exit status 1 when any status disagrees.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from birdenv.tasks import Task, load_tasks

OFFICIAL_TIMEOUT = 180  # seconds per instance, as the official wrapper
OFFICIAL_SCRIPT = "single_instance_eval_sqlite.py"


def _official_failure(row: dict[str, Any], message: str) -> dict[str, Any]:
    """The row the official wrapper records when its subprocess gives no result."""
    return {
        "instance_id": row["instance_id"],
        "status": "failed",
        "error_message": message,
        "total_test_cases": len(row.get("test_cases") or []),
        "passed_test_cases": 0,
        "failed_test_cases": [],
        "evaluation_phase_execution_error": True,
        "evaluation_phase_timeout_error": False,
        "evaluation_phase_assertion_error": False,
    }


def run_official(
    rows: list[dict[str, Any]], db_dir: Path, src: Path, *, jobs: int, python: str, work: Path
) -> list[dict[str, Any]]:
    """Judge ``rows`` (task rows with ``pred_sqls``) with the official per-instance script."""
    script = src / OFFICIAL_SCRIPT
    if not script.is_file():
        raise SystemExit(f"no {OFFICIAL_SCRIPT} in {src}: pass --official-src")

    def one(index: int, row: dict[str, Any]) -> dict[str, Any]:
        db_id = row["db_id"]
        folder = work / str(index) / db_id
        folder.mkdir(parents=True)
        template = Path(db_dir) / db_id / f"{db_id}_template.sqlite"
        # The official reset looks for "{db}_template.sqlite" beside the ephemeral copy.
        (folder / template.name).symlink_to(template.resolve())
        ephemeral = folder / f"{db_id}_ephemeral_1.sqlite"
        shutil.copy2(template, ephemeral)
        given = folder.parent / "input.jsonl"
        given.write_text(json.dumps({**row, "_index": index}) + "\n", encoding="utf-8")
        result_path = folder.parent / "result.json"
        env = {**os.environ, "EPHEMERAL_DB_PATH": str(ephemeral)}
        command = [
            python, str(script), "--jsonl_file", str(given), "--output_file", str(result_path),
            "--mode", "pred", "--logging", "false", "--log_file", str(folder.parent / "log"),
        ]  # fmt: skip
        try:
            proc = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=OFFICIAL_TIMEOUT
            )
        except subprocess.TimeoutExpired:
            return _official_failure(row, "Failed to evaluate instance (subprocess error)")
        if proc.returncode != 0 or not result_path.is_file() or not result_path.stat().st_size:
            return _official_failure(row, "Failed to evaluate instance (subprocess error)")
        result = json.loads(result_path.read_text(encoding="utf-8"))
        result["instance_id"] = row["instance_id"]
        return result

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, range(len(rows)), rows))


def run_ours(
    input_path: Path, db_dir: Path, out_path: Path, *, jobs: int, cache: bool = True
) -> list[dict[str, Any]]:
    """Judge the same input with ``birdenv evaluate``; verdict rows in input order."""
    command = [
        sys.executable, "-c", "import sys; from birdenv.cli import main; sys.exit(main())",
        "evaluate", str(input_path), "--db-dir", str(db_dir), "--out", str(out_path),
        "--jobs", str(jobs), *([] if cache else ["--no-cache"]),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0 or not out_path.is_file():
        raise SystemExit(f"birdenv evaluate failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in out_path.read_text(encoding="utf-8").splitlines() if line]


def prediction_sets(tasks: list[Task], predictions: Path | None) -> dict[str, list[dict[str, Any]]]:
    """The input rows of each set: full task rows plus ``pred_sqls``, with unique ids."""
    sets: dict[str, list[dict[str, Any]]] = {
        "gold": [
            {**t.to_dict(), "instance_id": f"{t.instance_id}#gold", "pred_sqls": list(t.sol_sql)}
            for t in tasks
            if t.sol_sql
        ],
        "issue": [
            {**t.to_dict(), "instance_id": f"{t.instance_id}#issue", "pred_sqls": list(t.issue_sql)}
            for t in tasks
        ],
    }
    if predictions is not None:
        by_id = {t.instance_id: t for t in tasks}
        rows = []
        lines = predictions.read_text(encoding="utf-8").splitlines()
        for k, line in enumerate(filter(str.strip, lines)):
            pred = json.loads(line)
            task = by_id[str(pred["instance_id"])]
            rows.append(
                {
                    **task.to_dict(),
                    "instance_id": f"{task.instance_id}#{k}",
                    "pred_sqls": pred["pred_sqls"],
                }
            )
        sets["predictions"] = rows
    return sets


def compare(name: str, official: list[dict], ours: list[dict], walls: tuple[float, float]) -> int:
    """Print agreement for one set; return the number of disagreements."""
    ours_by_id = {row.get("instance_id"): row for row in ours}
    disagreements = []
    for row in official:
        mine = ours_by_id.get(row["instance_id"], {"status": "missing"})
        if mine["status"] != row["status"]:
            disagreements.append((row, mine))
    n = len(official)
    official_ok = sum(r["status"] == "success" for r in official)
    ours_ok = sum(r.get("status") == "success" for r in ours)
    t_official, t_ours = walls
    print(
        f"{name:<12} n={n:<5} official success={official_ok:<5} ours success={ours_ok:<5} "
        f"agree={n - len(disagreements)}/{n}  wall official={t_official:.2f}s "
        f"ours={t_ours:.2f}s  speed-up x{t_official / max(t_ours, 1e-9):.1f}"
    )
    for row, mine in disagreements:
        official_error = (row.get("error_message") or "").strip().replace("\n", " | ")[:300]
        print(
            f"  DISAGREE {row['instance_id']}: official={row['status']} ours={mine['status']} "
            f"(ours phase={mine.get('phase')}; official: {official_error!r}; "
            f"ours: {(mine.get('error') or '')[:300]!r})"
        )
    return len(disagreements)


def main(argv: list[str] | None = None) -> int:
    """Run both evaluators on the gold, issue and optional predictions; print agreement."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--official-src",
        default=os.environ.get("BIRD_CRITIC_OFFICIAL_SRC"),
        help="folder with the official SQLite evaluator scripts (env BIRD_CRITIC_OFFICIAL_SRC)",
    )
    parser.add_argument("--suite", default="critic-mini", help="bundled suite (default)")
    parser.add_argument("--tasks", type=Path, help="official task JSONL instead of a suite")
    parser.add_argument("--db-dir", type=Path, help="{db_id}/{db_id}_template.sqlite folder")
    parser.add_argument("--predictions", type=Path, help="extra rows: instance_id + pred_sqls")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 4, help="both sides")
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter for the official scripts"
    )
    parser.add_argument("--sets", default="gold,issue,predictions", help="which sets to run")
    parser.add_argument("--keep", type=Path, help="keep inputs and outputs in this folder")
    args = parser.parse_args(argv)
    if not args.official_src:
        parser.error("pass --official-src or set BIRD_CRITIC_OFFICIAL_SRC")
    src = Path(args.official_src).resolve()

    tasks = load_tasks(args.tasks if args.tasks else args.suite, db_dir=args.db_dir)
    if not tasks:
        parser.error("no tasks")
    db_dir = Path(args.db_dir or tasks[0].db_dir).resolve()
    wanted = set(args.sets.split(","))
    sets = {k: v for k, v in prediction_sets(tasks, args.predictions).items() if k in wanted}

    work = Path(tempfile.mkdtemp(prefix="official_oracle_"))
    disagreements = 0
    try:
        print(f"{len(tasks)} tasks from {args.tasks or args.suite}; databases in {db_dir}")
        print(f"official evaluator from {src}; jobs={args.jobs}")
        for name, rows in sets.items():
            if not rows:
                continue
            input_path = work / f"{name}.input.jsonl"
            input_path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
            started = time.perf_counter()
            official = run_official(
                rows,
                db_dir,
                src,
                jobs=args.jobs,
                python=args.python,
                work=work / f"{name}.official",
            )
            t_official = time.perf_counter() - started
            started = time.perf_counter()
            cold = run_ours(
                input_path, db_dir, work / f"{name}.cold.jsonl", jobs=args.jobs, cache=False
            )
            t_cold = time.perf_counter() - started
            disagreements += compare(f"{name} (--no-cache)", official, cold, (t_official, t_cold))
            started = time.perf_counter()
            ours = run_ours(input_path, db_dir, work / f"{name}.ours.jsonl", jobs=args.jobs)
            t_ours = time.perf_counter() - started
            cached = sum(bool(v.get("issue_cached")) for v in ours)
            print(f"  (cached issue phases in the run below: {cached}/{len(ours)})")
            with (work / f"{name}.official.jsonl").open("w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in official)
            disagreements += compare(name, official, ours, (t_official, t_ours))
    finally:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            for path in work.glob("*.jsonl"):
                shutil.copy2(path, args.keep / path.name)
        shutil.rmtree(work, ignore_errors=True)
    return 1 if disagreements else 0


if __name__ == "__main__":
    raise SystemExit(main())

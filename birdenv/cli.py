"""The ``birdenv`` command: bundled data, official-style evaluation, a terminal agent, diagnostics.

birdenv data list | build [--force] | validate [--suite NAME | --tasks T --db-dir D]
birdenv evaluate PRED [--suite S | --tasks T --db-dir D] [--scorer auto|critic|ex] [--out OUT] [--jobs N]
birdenv doctor
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from birdenv import suites
from birdenv.bird import BIRD_SEPARATOR
from birdenv.errors import BirdEnvError, TaskFormatError
from birdenv.judge import INSTANCE_TIMEOUT
from birdenv.tasks import CATEGORIES, Task, load_tasks

__all__ = ["main"]


def _progress(
    items: Iterable[Any], total: int, label: str, stream: TextIO = sys.stderr
) -> Iterator[Any]:
    """Yield ``items`` while drawing a one-line progress bar on a terminal (nothing otherwise)."""
    draw = stream.isatty() and total >= 20
    start = time.monotonic()
    for done, item in enumerate(items, 1):
        yield item
        if draw:
            width = 30
            filled = width * done // total
            rate = done / max(time.monotonic() - start, 1e-9)
            stream.write(
                f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {rate:.1f}/s"
            )
            stream.flush()
    if draw:
        stream.write("\n")


def _success_table(
    rows: list[dict[str, Any]],
    *,
    key: str = "category",
    order: tuple[str, ...] = CATEGORIES,
    metric: str = "SR %",
) -> str:
    """The share of successes overall and per ``key`` (Success Rate per category by default;
    execution accuracy per difficulty for BIRD), as the official reports count it."""
    by_category: dict[str, list[bool]] = defaultdict(list)
    for row in rows:
        by_category[row.get(key) or "unknown"].append(row["status"] == "success")
    ordered = [c for c in order if c in by_category] + sorted(set(by_category) - set(order))
    lines = [f"{key:<16}{'n':>6}{'success':>9}{metric:>8}"]
    for category in ordered:
        results = by_category[category]
        lines.append(
            f"{category:<16}{len(results):>6}{sum(results):>9}{100 * sum(results) / len(results):>8.2f}"
        )
    total = sum(len(r) for r in by_category.values())
    wins = sum(sum(r) for r in by_category.values())
    lines.append(f"{'overall':<16}{total:>6}{wins:>9}{(100 * wins / total if total else 0):>8.2f}")
    return "\n".join(lines)


# -- birdenv data ------------------------------------------------------------------------------
def _cmd_data_list(args: argparse.Namespace) -> int:
    suite = suites.ensure()
    for name, purpose in suites.SUITES.items():
        tasks = load_tasks(name)
        counts = Counter(t.category for t in tasks)
        cats = ", ".join(f"{c} {counts[c]}" for c in CATEGORIES if counts[c])
        print(f"{name:<12} {len(tasks):>4} tasks ({cats}) - {purpose}")
    print(f"\ndatabases in {suite.db_dir}:")
    for db_id in suites.database_modules():
        path = suite.db_dir / db_id / f"{db_id}_template.sqlite"
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
            tables = conn.execute(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table'"
            ).fetchone()[0]
        conn.close()
        print(f"  {db_id:<20} {path.stat().st_size / 1e6:>8.1f} MB  {tables:>3} tables")
    return 0


def _cmd_data_build(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    suite = suites.ensure(verify=True, force=args.force)
    print(
        f"built and verified the bundled suites in {time.perf_counter() - start:.1f} s: {suite.db_dir.parent}"
    )
    return 0


def _select_tasks(args: argparse.Namespace) -> list[Task]:
    if args.tasks:
        return load_tasks(args.tasks, db_dir=args.db_dir)
    return load_tasks(args.suite or "critic-mini")


def _cmd_data_validate(args: argparse.Namespace) -> int:
    """Every task's gold must pass, hence its issue SQL must fail.

    Judging the gold runs the official first phase too, which fails the instance when the issue
    SQL passes the tests: one verdict checks both.
    """
    from birdenv.judge import judge_many

    if args.bird:
        from birdenv.bird import load_bird
        from birdenv.ex import validate_bird

        questions = load_bird(args.bird, db_dir=args.db_root)
        problems = validate_bird(questions, max_seconds=1.0)
        for line in problems:
            print(line)
        print(
            f"{len(questions) - len(problems)}/{len(questions)} questions valid (gold runs, non-empty, < 1 s)"
        )
        return 1 if problems else 0
    tasks = _select_tasks(args)
    verdicts = _progress(
        judge_many(((t, t.sol_sql) for t in tasks), processes=args.jobs), len(tasks), "validating"
    )
    problems = 0
    for task, verdict in zip(tasks, verdicts, strict=True):
        if not task.issue_sql:
            problem = "has no issue_sql"
        elif verdict.phase == "issue":
            problem = "issue_sql passes its own tests"
        elif not verdict.passed:
            problem = f"gold fails ({verdict.phase}): {verdict.error}"
        else:
            continue
        problems += 1
        print(f"{task.instance_id}: {problem}")
    print(f"{len(tasks) - problems}/{len(tasks)} tasks valid (gold passes, issue SQL fails)")
    return 0 if not problems else 1


# -- birdenv evaluate --------------------------------------------------------------------------
class _InputError(str):
    """An input row that cannot be scored: the message says which row and why.

    A ``str`` subclass, so the critic path's ``isinstance(item, str)`` checks see it, and distinct
    from a JSONL line that is itself a JSON string.
    """


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line, decoded row | error message)`` for each non-blank line of a JSONL file."""
    with path.open(encoding="utf-8") as fh:
        for lineno, text in enumerate(fh, 1):
            if not text.strip():
                continue
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as exc:
                yield lineno, _InputError(f"{path}:{lineno}: not valid JSON ({exc.msg})")


def _read_predictions(path: Path, args: argparse.Namespace) -> Iterator[tuple[int, Any]]:
    """Yield ``(line, (task, pred_sqls, warnings) | error message)`` for each input row."""
    known: dict[str, Task] | None = None
    db_dir = args.db_dir
    for lineno, row in _jsonl_rows(path):
        where = f"{path}:{lineno}"
        if isinstance(row, _InputError):
            yield lineno, row
            continue
        if not isinstance(row, dict) or "pred_sqls" not in row:
            yield lineno, f"{where}: expected an object with 'pred_sqls'"
            continue
        warnings = []
        pred = row.pop("pred_sqls")
        if isinstance(pred, str):
            warnings.append(
                "pred_sqls is a string, not a list: split on [split] as the official reader does"
            )
        elif not isinstance(pred, list) or not all(isinstance(s, str) for s in pred):
            yield lineno, f"{where}: field 'pred_sqls': expected a list of SQL strings"
            continue
        if "issue_sql" in row or "error_sql" in row:  # a full task row, the official input form
            from birdenv.tasks import parse_task

            try:
                task = parse_task(
                    row, source=str(path), line=lineno, db_dir=db_dir or _default_db_dir(args)
                )
            except TaskFormatError as exc:
                yield lineno, str(exc)
                continue
        else:
            if known is None:
                known = {t.instance_id: t for t in _select_tasks(args)}
            task = known.get(str(row.get("instance_id")))
            if task is None:
                yield (
                    lineno,
                    f"{where}: instance_id {row.get('instance_id')!r} is not in the task set",
                )
                continue
        yield lineno, (task, pred, warnings)


def _default_db_dir(args: argparse.Namespace) -> Path:
    return Path(args.db_dir) if args.db_dir else load_tasks(args.suite or "critic-mini")[0].db_dir


def _scored_rows(
    entries: list[tuple[int, Any]],
    verdicts: Iterator[Any],
    path: Path,
    fields: Callable[[Any], dict[str, Any]],
) -> list[dict[str, Any]]:
    """One output row per input entry, in input order: an ``"input"`` failure for a row that could
    not be read (with a warning naming it), else its verdict plus ``fields(task)`` and any
    warnings. ``verdicts`` yields one verdict per readable entry, in order."""
    rows = []
    for line, item in entries:
        if isinstance(item, str):
            print(f"warning: {item}", file=sys.stderr)
            rows.append(
                {
                    "instance_id": None,
                    "status": "failed",
                    "phase": "input",
                    "error": item,
                    "line": line,
                }
            )
            continue
        task, _, warnings = item
        verdict = next(verdicts)
        row = {**verdict.to_dict(), **fields(task), "line": line}
        if warnings:
            row["warnings"] = warnings
            for warning in warnings:
                print(f"warning: {path}:{line}: {warning}", file=sys.stderr)
        rows.append(row)
    return rows


def _write_verdicts(rows: list[dict[str, Any]], path: Path, args: argparse.Namespace) -> Path:
    out = Path(args.out) if args.out else path.with_name(path.stem + ".verdicts.jsonl")
    with out.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return out


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from birdenv.judge import judge_many

    path = Path(args.predictions)
    if not path.is_file():
        print(f"birdenv evaluate: no such file: {path}", file=sys.stderr)
        return 2
    scorer, reason = _pick_scorer(args, path)
    if scorer == "ex":
        print(f"scoring BIRD execution accuracy ({reason})", file=sys.stderr)
        return _evaluate_bird(args, path)
    entries = list(_read_predictions(path, args))
    good = [(line, item) for line, item in entries if not isinstance(item, str)]
    started = time.perf_counter()
    verdicts = iter(
        _progress(
            judge_many(
                ((task, pred) for _, (task, pred, _) in good),
                processes=args.jobs,
                statement_timeout=args.statement_timeout,
                instance_timeout=args.instance_timeout,
                cache=args.cache,
            ),
            len(good),
            "judging",
        )
    )
    rows = _scored_rows(entries, verdicts, path, lambda task: {"category": task.category})
    elapsed = time.perf_counter() - started
    out = _write_verdicts(rows, path, args)
    print(_success_table(rows))
    print(f"judged {len(good)} predictions in {elapsed:.1f} s; verdicts written to {out}")
    return 0


# -- birdenv evaluate, BIRD text-to-SQL ----------------------------------------------------------
_CRITIC_KEYS = ("pred_sqls", "instance_id", "issue_sql", "error_sql")
_BIRD_KEYS = ("question_id", "pred_sql", "SQL")


def _bird_object(path: Path) -> dict[str, Any] | None:
    """The prediction file as BIRD's official JSON object ``{question_id: "SQL<sep>db_id"}``, or
    ``None`` when it is not one (JSONL rows, one per line, are read elsewhere)."""
    with path.open(encoding="utf-8") as fh:
        head = fh.read(1 << 16)
    if not head.lstrip().startswith("{"):
        return None
    try:
        whole = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None  # several lines of JSON objects: JSONL
    if not isinstance(whole, dict) or any(k in whole for k in (*_CRITIC_KEYS, *_BIRD_KEYS)):
        return None  # a single JSONL row
    return whole


def _pick_scorer(args: argparse.Namespace, path: Path) -> tuple[str, str]:
    """``("critic" | "ex", why)``: ``--scorer``, else the suite, else the input's own shape."""
    from birdenv.bird import BIRD_SUITES

    if args.scorer != "auto":
        return args.scorer, f"--scorer {args.scorer}"
    if args.suite:
        return ("ex" if args.suite in BIRD_SUITES else "critic"), f"--suite {args.suite}"
    if _bird_object(path) is not None:
        return "ex", "an official BIRD prediction file"
    for source, label in ((path, "prediction"), (Path(args.tasks or ""), "task")):
        if not source.is_file():
            continue
        # JSONL, or one JSON array as the official dev.json is.
        first = next((row for _, row in _bird_rows(source) if isinstance(row, dict)), None)
        if isinstance(first, dict) and any(k in first for k in _CRITIC_KEYS):
            return "critic", f"the {label} rows are BIRD-CRITIC rows"
        if isinstance(first, dict) and any(k in first for k in _BIRD_KEYS):
            return "ex", f"the {label} rows are BIRD rows"
    return "critic", "the default"


def _bird_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line, row)`` of a JSONL file, or ``(item, row)`` of a file holding one JSON array."""
    with path.open(encoding="utf-8") as fh:
        is_array = fh.read(1 << 16).lstrip().startswith("[")
    if is_array:
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            yield exc.lineno, _InputError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})")
            return
        yield from enumerate(rows, 1)
        return
    yield from _jsonl_rows(path)


def _read_bird_predictions(path: Path) -> Iterator[tuple[int, str, Any]]:
    """Yield ``(position, where, (question_id, sql, db_id | None, warnings) | error)`` for each
    prediction; ``where`` names the entry in messages.

    Two forms: BIRD's own JSON object ``{"<question_id>": "<SQL>\\t----- bird -----\\t<db_id>"}``
    (position = the entry's rank in the object) or rows with ``question_id`` and ``pred_sql`` (or
    ``SQL``; ``pred_sql`` wins when a row has both, so a task row can carry its prediction), one
    a line (JSONL) or in one JSON array.
    """
    whole = _bird_object(path)
    if whole is not None:
        for position, (key, value) in enumerate(whole.items(), 1):
            where = f"{path}: entry {position} (key {key!r})"
            parts = value.split(BIRD_SEPARATOR) if isinstance(value, str) else []
            if not parts:
                error = f"expected a string 'SQL{BIRD_SEPARATOR}db_id', got {type(value).__name__}"
            elif len(parts) > 2:
                error = f"the separator {BIRD_SEPARATOR!r} appears more than once"
            else:
                warnings = []
                if len(parts) == 1:
                    warnings.append(
                        f"no {BIRD_SEPARATOR!r}db_id after the SQL: all of it is the SQL"
                    )
                db_id = parts[1].strip() if len(parts) == 2 else None
                yield position, where, (key, parts[0], db_id, warnings)
                continue
            yield position, where, _InputError(f"{where}: {error}")
        return
    for lineno, row in _bird_rows(path):
        where = f"{path}:{lineno}"
        if isinstance(row, _InputError):
            yield lineno, where, row
        elif not isinstance(row, dict) or "question_id" not in row:
            message = f"{where}: expected an object with 'question_id' and 'pred_sql'"
            yield lineno, where, _InputError(message)
        elif not isinstance(row.get("pred_sql", row.get("SQL")), str):
            message = f"{where}: field 'pred_sql' (or 'SQL'): expected an SQL string"
            yield lineno, where, _InputError(message)
        else:
            sql = row.get("pred_sql", row.get("SQL"))
            db_id = row.get("db_id") if isinstance(row.get("db_id"), str) else None
            yield lineno, where, (row["question_id"], sql, db_id, [])


def _bird_entries(path: Path, tasks: list[Any], source: str) -> list[tuple[int, Any]]:
    """The predictions matched to their questions by question id (the official scripts pair
    them by position; the id is what says which question a prediction answers):
    ``(position, (task, sql, warnings) | error)``. An unknown or repeated id is an error naming
    the entry; the first prediction of a question is the one scored."""
    by_id = {task.question_id: task for task in tasks}
    first_at: dict[int, str] = {}
    entries: list[tuple[int, Any]] = []
    for position, where, item in _read_bird_predictions(path):
        if isinstance(item, str):
            entries.append((position, item))
            continue
        raw_id, sql, db_id, warnings = item
        # The official object's keys are strings: "12" is question 12.
        qid = int(raw_id) if isinstance(raw_id, str) and raw_id.strip().isdigit() else raw_id
        if isinstance(qid, bool) or not isinstance(qid, int):
            error = f"question_id {raw_id!r} is not an integer"
        elif qid not in by_id:
            error = f"question_id {qid} is not in the task set ({source})"
        elif qid in first_at:
            error = f"question_id {qid} again (first at {first_at[qid]}): only the first is scored"
        else:
            first_at[qid] = where
            task = by_id[qid]
            if db_id is not None and db_id != task.db_id:
                warnings = [
                    *warnings,
                    f"db_id {db_id!r} is not the database of question {qid} ({task.db_id!r}): "
                    f"scored on {task.db_id!r}",
                ]
            entries.append((position, (task, sql, warnings)))
            continue
        entries.append((position, _InputError(f"{where}: {error}")))
    return entries


def _evaluate_bird(args: argparse.Namespace, path: Path) -> int:
    """Execution accuracy of BIRD predictions, overall and per difficulty, with the official rule.

    Every question of the task set counts: one with no (readable) prediction scores 0 (phase
    ``"missing"``), so EX is over the whole set as in BIRD's own report. Where the official
    scripts differ, on input only: they pair predictions with questions by position, here by
    question id; they score a non-string prediction as the query ``" "``, here it is a named bad
    entry (and its question scores 0); their time limit (30 s) covers the prediction and the gold
    together, here each one (``--statement-timeout``, default 30 s).
    """
    from birdenv.bird import DIFFICULTIES, load_bird
    from birdenv.ex import execution_accuracy_many

    db_root = args.db_root or args.db_dir
    if args.tasks:
        if not db_root:
            print(
                "birdenv evaluate: --tasks needs --db-root DIR (holding {db_id}/{db_id}.sqlite)",
                file=sys.stderr,
            )
            return 2
        source = args.tasks
        tasks = load_bird(args.tasks, db_dir=db_root)
    else:
        source = args.suite if args.suite else "bird-mini-eval"
        tasks = load_bird(source, db_dir=db_root)
    entries = _bird_entries(path, tasks, source)
    good = [item for _, item in entries if not isinstance(item, str)]
    started = time.perf_counter()
    verdicts = iter(
        _progress(
            execution_accuracy_many(
                ((task, sql) for task, sql, _ in good),
                processes=args.jobs,
                statement_timeout=30.0
                if args.statement_timeout is None
                else args.statement_timeout,
            ),
            len(good),
            "scoring",
        )
    )

    def fields(task: Any) -> dict[str, Any]:
        return {"question_id": task.question_id, "db_id": task.db_id, "difficulty": task.difficulty}

    rows = _scored_rows(entries, verdicts, path, fields)
    scored = {row["question_id"] for row in rows if row.get("phase") != "input"}
    missing = [task for task in tasks if task.question_id not in scored]
    for task in missing:
        rows.append(
            {
                "instance_id": task.instance_id,
                "status": "failed",
                "correct": False,
                "phase": "missing",
                "error": "no prediction for this question",
                **fields(task),
            }
        )
    if missing:
        print(
            f"warning: {len(missing)} of the {len(tasks)} questions have no prediction: scored 0",
            file=sys.stderr,
        )
    elapsed = time.perf_counter() - started
    out = _write_verdicts(rows, path, args)
    questions = [row for row in rows if row.get("phase") != "input"]
    print(_success_table(questions, key="difficulty", order=DIFFICULTIES, metric="EX %"))
    print(
        f"scored {len(good)} predictions for {len(tasks)} questions ({source}) in {elapsed:.1f} s; "
        f"verdicts written to {out}"
    )
    return 0


# -- birdenv demo ------------------------------------------------------------------------------
def _cmd_demo(args: argparse.Namespace) -> int:
    """Build the data, run reference agents through the environment, evaluate what they submitted."""
    import gymnasium as gym

    from birdenv.agents import AGENTS, run_episode

    start = time.perf_counter()
    suites.ensure(args.suite)
    tasks = load_tasks(args.suite)[: args.limit or None]
    print(f"{args.suite}: {len(tasks)} tasks, data ready in {time.perf_counter() - start:.1f} s")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = gym.make("BirdCritic-SQLite-v0", suite=args.suite)
    for name, agent_cls in AGENTS.items():
        agent = agent_cls()
        started = time.perf_counter()
        predictions = out_dir / f"{name}.predictions.jsonl"
        rewards = []
        with predictions.open("w", encoding="utf-8") as fh:
            for task in _progress(tasks, len(tasks), f"{name} agent"):
                reward, info = run_episode(env, agent, task.instance_id)
                rewards.append(reward)
                submitted = json.loads(
                    info["messages"][-2]["content"].split("<tool_call>")[1].split("</tool_call>")[0]
                )
                fh.write(
                    json.dumps(
                        {
                            "instance_id": task.instance_id,
                            "pred_sqls": submitted["arguments"]["sql_list"],
                        }
                    )
                    + "\n"
                )
        elapsed = time.perf_counter() - started
        print(
            f"\n{name} agent: mean reward {sum(rewards) / len(rewards):.3f} over {len(rewards)} episodes in {elapsed:.1f} s"
        )
        print(f"evaluating {predictions} with `birdenv evaluate`:")
        code = main(["evaluate", str(predictions), "--suite", args.suite, "--jobs", str(args.jobs)])
        if code:
            return code
    env.close()
    return 0


# -- birdenv play ------------------------------------------------------------------------------
def _cmd_play(args: argparse.Namespace) -> int:
    from birdenv.play import play

    if args.tasks:
        return play(args.task_id, tasks=args.tasks, db_dir=args.db_dir)
    return play(args.task_id, suite=args.suite)


# -- birdenv doctor ----------------------------------------------------------------------------
def _cmd_doctor(args: argparse.Namespace) -> int:
    from birdenv.replicas import descriptors, overlay
    from birdenv.replicas.pool import (
        MEMORY_HEADROOM,
        default_root,
        default_sessions_dir,
        is_memory_filesystem,
    )

    root = default_root()
    sessions = default_sessions_dir(root)
    print(f"python           {sys.version.split()[0]}")
    print(f"sqlite (stdlib)  {sqlite3.sqlite_version}")
    print(f"cache            {suites.home()}")
    print(f"replica root     {root}")
    if is_memory_filesystem(sessions):
        print(
            f"sessions         {sessions} (memory; on disk in {root / 'sessions'} while it has "
            f"under {MEMORY_HEADROOM >> 30} GiB free)"
        )
    else:
        print(f"sessions         {sessions} (disk)")
    soft, hard = descriptors.limits()
    print(
        f"open files       soft limit {soft}, hard {hard}: a replica pool raises the soft limit "
        "to the hard one; each open session holds 2-4"
    )
    if overlay.available():
        print("strategy         overlay (copy-on-write page overlay VFS)")
    else:
        print(f"strategy         copy (overlay unavailable: {overlay.unavailable_reason()})")
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="birdenv", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    data = commands.add_parser("data", help="the bundled suites").add_subparsers(
        dest="data_command", required=True
    )
    data.add_parser(
        "list", help="suites, task counts per category, databases and sizes"
    ).set_defaults(func=_cmd_data_list)
    build = data.add_parser("build", help="build (or rebuild) the bundled databases")
    build.add_argument("--force", action="store_true", help="rebuild even when the cache is intact")
    build.set_defaults(func=_cmd_data_build)
    validate = data.add_parser(
        "validate", help="judge every task's gold (must pass) and issue SQL (must fail)"
    )
    _add_task_source(validate)
    validate.add_argument(
        "--bird",
        metavar="NAME_OR_PATH",
        help="validate BIRD questions instead: bird-mini-train, bird-mini-eval or a file",
    )
    validate.add_argument(
        "--db-root", help="folder holding {db_id}/{db_id}.sqlite (with --bird FILE)"
    )
    validate.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    validate.set_defaults(func=_cmd_data_validate)

    evaluate = commands.add_parser(
        "evaluate",
        help="judge predictions like the official evaluators (BIRD-CRITIC SR, or BIRD EX)",
    )
    evaluate.add_argument(
        "predictions",
        help="BIRD-CRITIC JSONL (task rows with pred_sqls, or instance_id + pred_sqls); or BIRD "
        "predictions: the official JSON object {question_id: 'SQL\\t----- bird -----\\tdb_id'} "
        "or JSONL rows of question_id + pred_sql (or SQL)",
    )
    _add_task_source(evaluate, bird=True)
    evaluate.add_argument(
        "--db-root", help="BIRD: folder holding {db_id}/{db_id}.sqlite (with --tasks dev.json)"
    )
    evaluate.add_argument(
        "--scorer",
        choices=("auto", "critic", "ex"),
        default="auto",
        help="critic: BIRD-CRITIC's judge (Success Rate by category); ex: BIRD's execution "
        "accuracy by difficulty; auto (default): from --suite, else from the shape of the input",
    )
    evaluate.add_argument(
        "--out", help="verdicts JSONL (default: PRED.verdicts.jsonl beside the input)"
    )
    evaluate.add_argument("--jobs", type=int, default=1, help="worker processes")
    evaluate.add_argument(
        "--statement-timeout",
        type=float,
        default=None,
        help="seconds per statement (default: none, like the official BIRD-CRITIC evaluator; "
        "30 for BIRD EX, the official meta_time_out)",
    )
    evaluate.add_argument(
        "--instance-timeout",
        type=float,
        default=INSTANCE_TIMEOUT,
        help="seconds per instance; a worker past it is killed (default: the official 180)",
    )
    evaluate.add_argument(
        "--no-cache",
        dest="cache",
        action="store_false",
        help=(
            "run every issue phase again instead of reusing remembered outcomes, and judge in "
            "input order (not slowest first by remembered times)"
        ),
    )
    evaluate.set_defaults(func=_cmd_evaluate)

    play = commands.add_parser("play", help="be the agent yourself on a task, in the terminal")
    play.add_argument("task_id", nargs="?", help="task to play (default: one at random)")
    _add_task_source(play)
    play.set_defaults(func=_cmd_play)

    demo = commands.add_parser(
        "demo", help="build data, run reference agents in the env, evaluate them"
    )
    demo.add_argument("--suite", default="critic-mini", choices=suites.names())
    demo.add_argument("--limit", type=int, default=0, help="only the first N tasks (0: all)")
    demo.add_argument("--out", default="runs/demo", help="where predictions and verdicts go")
    demo.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="judging processes")
    demo.set_defaults(func=_cmd_demo)

    commands.add_parser("doctor", help="which replica strategy is in use, and why").set_defaults(
        func=_cmd_doctor
    )
    return parser


def _add_task_source(parser: argparse.ArgumentParser, *, bird: bool = False) -> None:
    if bird:  # no default: the suite, if given, also says which scorer applies
        from birdenv.bird import BIRD_SUITES

        parser.add_argument(
            "--suite",
            choices=[*suites.names(), *BIRD_SUITES],
            help="bundled suite (default: critic-mini, or bird-mini-eval for BIRD predictions)",
        )
    else:
        parser.add_argument(
            "--suite", default="critic-mini", choices=suites.names(), help="bundled suite"
        )
    parser.add_argument(
        "--tasks",
        help="official task file instead of a bundled suite: BIRD-CRITIC JSONL"
        + (", or BIRD questions (dev.json, mini_dev_sqlite.json or JSONL)" if bird else ""),
    )
    parser.add_argument("--db-dir", help="folder holding {db_id}/{db_id}_template.sqlite")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``birdenv`` command."""
    args = _build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BirdEnvError as exc:
        print(f"birdenv: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

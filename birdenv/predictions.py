"""Prediction files of every accepted form, read, matched to their tasks and judged.

BIRD-CRITIC predictions are JSONL (or one JSON array) rows: ``instance_id`` + ``pred_sqls``, or a
whole task row with ``pred_sqls`` (the official input form). BIRD predictions are BIRD's own JSON
object ``{"<question_id>": "<SQL>\\t----- bird -----\\t<db_id>"}``, or rows of ``question_id`` +
``pred_sql`` (or ``SQL``). :func:`choose_kind` tells which kind a file holds, :func:`read_predictions`
reads it (a row that cannot be scored is a :class:`~birdenv.errors.PredictionFormatError` in its
place, so the rest is still scored), and :func:`evaluate_file` judges it with the official rules.

>>> kind, why = choose_kind(Path("preds.jsonl"), scorer="auto", suite="critic-mini")
>>> kind.kind, why
('critic', '--suite critic-mini')
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from birdenv import suites
from birdenv.errors import ArgumentError, PredictionFormatError, TaskFormatError, TaskKindError
from birdenv.judge import INSTANCE_TIMEOUT, score_many
from birdenv.rows import read_rows, read_text
from birdenv.tasks import BaseTask, Task, parse_task, source_kind
from birdenv.tasks.bird import BIRD_SEPARATOR, BirdTask

__all__ = [
    "SCORERS",
    "Evaluation",
    "Layout",
    "Prediction",
    "choose_kind",
    "evaluate_file",
    "layout_of",
    "read_predictions",
    "register_layout",
    "write_jsonl",
]

#: The scorers a caller can force, by name: BIRD-CRITIC's judge, or BIRD's execution accuracy.
SCORERS: dict[str, type[BaseTask]] = {"critic": Task, "ex": BirdTask}
_CRITIC_KEYS = ("pred_sqls", "instance_id", "issue_sql", "error_sql")
_BIRD_KEYS = ("question_id", "pred_sql", "SQL")

Progress = Callable[[Iterable[Any], int, str], Iterable[Any]]


@dataclasses.dataclass
class Prediction:
    """One prediction of a file, matched to its task.

    ``line`` is its line (JSONL), item (JSON array) or entry (BIRD's JSON object); ``warnings``
    say what was read in a way the reader should know about.
    """

    line: int
    task: BaseTask
    sql_list: list[str] | str
    warnings: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Evaluation:
    """The outcome of :func:`evaluate_file`.

    ``rows`` holds one verdict row per entry of the file, in order (a row that could not be read
    is a failure of phase ``"input"``), then, for BIRD, one ``"missing"`` row per question without
    a prediction. ``counted`` are the rows the metric is over: for BIRD-CRITIC every row (a row
    that cannot be read fails, as an instance), for BIRD every question once (a bad entry names no
    question). ``warnings`` are the lines to show the user, in order.
    """

    kind: type[BaseTask]
    source: str
    rows: list[dict[str, Any]]
    counted: list[dict[str, Any]]
    judged: int
    seconds: float
    warnings: list[str]


def choose_kind(
    path: Path, *, scorer: str = "auto", suite: str | None = None, tasks: str | None = None
) -> tuple[type[BaseTask], str]:
    """The kind of task a prediction file is judged as, and why: ``scorer`` (``"critic"``,
    ``"ex"``) when not ``"auto"``, else the suite's kind, else the file's own shape (BIRD's JSON
    object, or the first row's fields; then the task file's), else debugging tasks."""
    if scorer != "auto":
        return SCORERS[scorer], f"--scorer {scorer}"
    if suite:
        return source_kind(suite), f"--suite {suite}"
    if _bird_object(path) is not None:
        return BirdTask, "an official BIRD prediction file"
    for source, label, error in (
        (path, "prediction", PredictionFormatError),
        (Path(tasks or ""), "task", TaskFormatError),
    ):
        if not source.is_file():
            continue
        # JSONL, or one JSON array as the official dev.json is.
        rows = (item[1] for item in read_rows(source, error=error) if not isinstance(item, error))
        first = next((row for row in rows if isinstance(row, dict)), {})
        if first.keys() & set(_CRITIC_KEYS):
            return Task, f"the {label} rows are BIRD-CRITIC rows"
        if first.keys() & set(_BIRD_KEYS):
            return BirdTask, f"the {label} rows are BIRD rows"
    return Task, "the default"


def read_predictions(
    path: Path,
    kind: type[BaseTask],
    *,
    suite: str | None = None,
    tasks: str | None = None,
    db_dir: str | Path | None = None,
) -> tuple[list[Prediction | PredictionFormatError], list[BaseTask], str]:
    """The entries of a prediction file, each a :class:`Prediction` or the error naming it; the
    task set they were matched against; and its name.

    The task set is ``tasks`` (a file, with ``db_dir``), else ``suite``, else the kind's
    evaluation suite. A file that is not UTF-8 raises :class:`PredictionFormatError`.
    """
    source = tasks or suite or kind.eval_suite
    layout = layout_of(kind)
    if tasks and not db_dir and layout.needs_db_dir:
        raise ArgumentError(layout.needs_db_dir)
    task_set: list[BaseTask] = []

    def task_set_once() -> list[BaseTask]:
        if not task_set:
            task_set.extend(kind.load(source, db_dir=db_dir))
        return task_set

    return list(layout.read(path, task_set_once, source, db_dir)), task_set, source


def evaluate_file(
    path: Path,
    kind: type[BaseTask],
    *,
    suite: str | None = None,
    tasks: str | None = None,
    db_dir: str | Path | None = None,
    jobs: int | None = None,
    statement_timeout: float | None = None,
    instance_timeout: float = INSTANCE_TIMEOUT,
    cache: bool = True,
    ray: bool = False,
    progress: Progress = lambda items, total, label: items,
) -> Evaluation:
    """Judge every prediction of a file with the official rules of its kind, in ``jobs`` workers
    (default one; with ``ray=True``, Ray workers over the cluster, by default one per CPU of it).

    Each prediction is judged by the judge of its task's kind and dialect under the official
    rule (:func:`birdenv.judge.score_many` with ``official=True``), ``statement_timeout`` per
    statement (default: the official evaluator's, none for BIRD-CRITIC on SQLite, 30 s for BIRD);
    ``instance_timeout`` per instance and ``cache`` for the issue phases go to BIRD-CRITIC's
    judge on SQLite. The kind's :class:`Layout` says how its file is read and what counts: for
    BIRD every question of the task set, one without a prediction scoring 0 (phase
    ``"missing"``). Where this differs
    from BIRD's scripts, on input only: they pair predictions with questions by position, here by
    question id; a non-string prediction is a named bad entry (they run it as ``" "``).
    ``progress(iterable, total, label)`` wraps the verdict stream (a progress bar).
    """
    entries, task_set, source = read_predictions(
        path, kind, suite=suite, tasks=tasks, db_dir=db_dir
    )
    good = [entry for entry in entries if isinstance(entry, Prediction)]
    started = time.perf_counter()
    verdicts = score_many(
        ((entry.task, entry.sql_list) for entry in good),
        processes=jobs,
        statement_timeout="official" if statement_timeout is None else statement_timeout,
        official=True,
        ray=ray,
        instance_timeout=instance_timeout,
        cache=cache,
    )
    stream = iter(progress(verdicts, len(good), "judging"))
    rows, warnings = [], []
    for entry in entries:
        if isinstance(entry, PredictionFormatError):
            warnings.append(f"warning: {entry}")
            rows.append(
                {
                    "instance_id": None,
                    "status": "failed",
                    "phase": "input",
                    "error": str(entry),
                    "line": entry.line,
                }
            )
            continue
        row = {**next(stream).to_dict(), **entry.task.verdict_fields(), "line": entry.line}
        if entry.warnings:
            row["warnings"] = entry.warnings
            warnings.extend(f"warning: {path}:{entry.line}: {w}" for w in entry.warnings)
        rows.append(row)
    counted = rows
    if layout_of(kind).every_task_counts:
        counted = [row for row in rows if row.get("phase") != "input"]
        scored = {row["instance_id"] for row in counted}
        missing = [task for task in task_set if task.instance_id not in scored]
        missing_rows = [
            {
                "instance_id": task.instance_id,
                "status": "failed",
                "correct": False,
                "phase": "missing",
                "error": "no prediction for this question",
                **task.verdict_fields(),
            }
            for task in missing
        ]
        rows.extend(missing_rows)
        counted.extend(missing_rows)
        if missing:
            warnings.append(
                f"warning: {len(missing)} of the {len(task_set)} questions have no prediction: "
                "scored 0"
            )
    seconds = time.perf_counter() - started
    return Evaluation(kind, source, rows, counted, len(good), seconds, warnings)


def write_jsonl(rows: Iterable[dict[str, Any]], out: Path) -> Path:
    """Write rows (predictions, verdicts) as JSONL (UTF-8, non-ASCII kept) and return the path."""
    with out.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return out


# -- BIRD-CRITIC ------------------------------------------------------------------------------------
def _critic_entries(
    path: Path, task_set: Callable[[], list[BaseTask]], source: str, db_dir: str | Path | None
) -> Iterator[Prediction | PredictionFormatError]:
    known: dict[str, BaseTask] | None = None
    for item in read_rows(path, error=PredictionFormatError):
        if isinstance(item, PredictionFormatError):
            yield item
            continue
        line, row = item
        where = f"{path}:{line}"
        if not isinstance(row, dict) or "pred_sqls" not in row:
            yield PredictionFormatError(f"{where}: expected an object with 'pred_sqls'", line=line)
            continue
        warnings = []
        pred = row.pop("pred_sqls")
        if isinstance(pred, str):
            warnings.append(
                "pred_sqls is a string, not a list: split on [split] as the official reader does"
            )
        elif not isinstance(pred, list) or not all(isinstance(s, str) for s in pred):
            yield PredictionFormatError(
                f"{where}: field 'pred_sqls': expected a list of SQL strings", line=line
            )
            continue
        if "issue_sql" in row or "error_sql" in row:  # a full task row, the official input form
            try:
                folder = db_dir or suites.ensure().db_dir  # the bundled suites' databases
                task: BaseTask | None = parse_task(row, source=str(path), line=line, db_dir=folder)
            except TaskFormatError as exc:
                yield PredictionFormatError(str(exc), line=line)
                continue
        else:
            if known is None:
                known = {t.instance_id: t for t in task_set()}
            task = known.get(str(row.get("instance_id")))
            if task is None:
                yield PredictionFormatError(
                    f"{where}: instance_id {row.get('instance_id')!r} is not in the task set",
                    line=line,
                )
                continue
        yield Prediction(line, task, pred, warnings)


# -- BIRD -------------------------------------------------------------------------------------------
def _bird_object(path: Path) -> dict[str, Any] | None:
    """The file as BIRD's official JSON object ``{question_id: "SQL<sep>db_id"}``, or ``None``
    when it is not one (JSONL rows, one per line, are read elsewhere)."""
    text = read_text(path, error=PredictionFormatError)
    if not text.lstrip().startswith("{"):
        return None
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return None  # several lines of JSON objects: JSONL
    if not isinstance(whole, dict) or any(k in whole for k in (*_CRITIC_KEYS, *_BIRD_KEYS)):
        return None  # a single JSONL row
    return whole


def _write_bird_object(folder: Path, pairs: list[tuple[Any, list[str]]]) -> Path:
    """BIRD's official ``predict.json`` in ``folder``: ``{question_id: "SQL<sep>db_id"}``, the
    last statement of each submission its answer (an empty one: an empty answer)."""
    official = {
        task.instance_id: f"{(sql_list or [''])[-1]}{BIRD_SEPARATOR}{task.db_id}"
        for task, sql_list in pairs
    }
    path = folder / "predict.json"
    path.write_text(json.dumps(official, indent=2))
    return path


def _bird_predictions(path: Path) -> Iterator[tuple[int, str, Any]]:
    """``(position, where, (question_id, sql, db_id | None, warnings) | error)`` of each entry."""
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
            yield position, where, PredictionFormatError(f"{where}: {error}", line=position)
        return
    for item in read_rows(path, error=PredictionFormatError):
        if isinstance(item, PredictionFormatError):
            yield item.line, str(path), item
            continue
        line, row = item
        where = f"{path}:{line}"
        if not isinstance(row, dict) or "question_id" not in row:
            message = f"{where}: expected an object with 'question_id' and 'pred_sql'"
            yield line, where, PredictionFormatError(message, line=line)
        elif not isinstance(row.get("pred_sql", row.get("SQL")), str):
            message = f"{where}: field 'pred_sql' (or 'SQL'): expected an SQL string"
            yield line, where, PredictionFormatError(message, line=line)
        else:
            sql = row.get("pred_sql", row.get("SQL"))
            db_id = row.get("db_id") if isinstance(row.get("db_id"), str) else None
            yield line, where, (row["question_id"], sql, db_id, [])


def _bird_entries(
    path: Path, task_set: Callable[[], list[BaseTask]], source: str, db_dir: str | Path | None
) -> list[Prediction | PredictionFormatError]:
    """The predictions matched to their questions by question id (the official scripts pair them
    by position; the id is what says which question a prediction answers). An unknown or repeated
    id is an error naming the entry; the first prediction of a question is the one scored."""
    by_id = {task.question_id: task for task in task_set()}
    first_at: dict[int, str] = {}
    entries: list[Prediction | PredictionFormatError] = []
    for position, where, item in _bird_predictions(path):
        if isinstance(item, PredictionFormatError):
            entries.append(item)
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
            entries.append(Prediction(position, task, [sql], warnings))
            continue
        entries.append(PredictionFormatError(f"{where}: {error}", line=position))
    return entries


# -- the layouts, by kind -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layout:
    """How the official prediction files of one kind of task are read and counted.

    ``read(path, task_set, source, db_dir)`` gives each entry of the file as a
    :class:`Prediction` or the :class:`PredictionFormatError` naming it (``task_set()`` loads the
    task set, named ``source``, when the entries need it); ``every_task_counts``: each task of
    the set counts once, a task without a prediction as a failure (BIRD's rule), rather than each
    entry; ``needs_db_dir``, when not empty, is the error for a task file given without its
    databases' folder; ``write(folder, [(task, sql_list), ...])``, where the kind has an official
    file of its own beyond ``instance_id`` + ``pred_sqls`` rows, writes it into ``folder`` and
    returns its path.
    """

    read: Callable[..., Iterable[Prediction | PredictionFormatError]]
    every_task_counts: bool = False
    needs_db_dir: str = ""
    write: Callable[[Path, list[tuple[Any, list[str]]]], Path] | None = None


_LAYOUTS: dict[str, Layout] = {
    Task.kind: Layout(_critic_entries),
    BirdTask.kind: Layout(
        _bird_entries,
        every_task_counts=True,
        write=_write_bird_object,
        needs_db_dir="BIRD questions from a file need their database folder: --db-dir DIR "
        "(db_dir=), holding {db_id}/{db_id}.sqlite",
    ),
}


def register_layout(kind: str, layout: Layout) -> None:
    """Read and count the prediction files of the tasks of ``kind`` (a kind's name) by ``layout``."""
    _LAYOUTS[kind] = layout


def layout_of(kind: type[BaseTask]) -> Layout:
    """The :class:`Layout` of ``kind``'s prediction files; :class:`TaskKindError` when none is
    registered."""
    try:
        return _LAYOUTS[kind.kind]
    except KeyError:
        raise TaskKindError(
            f"no prediction file layout for {kind.kind} tasks; layouts exist for "
            f"{', '.join(sorted(_LAYOUTS))}"
        ) from None

"""Stage-1 data: single-turn reasoning examples, ``<thought>`` then ``<solution>`` with the fix.

Every example is in TRL's conversational prompt-completion form::

    {"prompt": [{"role": "user", "content": single_turn_prompt(task)}],
     "completion": [{"role": "assistant", "content": format_answer(thought, task.sol_sql)}],
     "task_id": "..."}

The thought is written from real evidence gathered on the task's database
(:mod:`birdtrain.data.evidence`): what the problematic SQL actually does there (its error, its
first rows or the rows it changes), which parts of its syntax tree the fix changes, and what the
fixed SQL returns. Offline, a fixed narrative turns that evidence into a diagnosis told as a
discovery; with a :class:`~birdtrain.endpoint.Teacher`, the teacher gets the task, the fix and
the same evidence and writes the thought. Only examples whose parsed solution the judge accepts
are kept.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from birdenv.errors import PreprocessError
from birdenv.judge import score_many
from birdenv.replicas.pool import ReplicaPool, default_pool
from birdenv.schema import PromptOptions
from birdenv.tasks import Task
from birdtrain.data.evidence import Evidence, gather_evidence, summarize_run
from birdtrain.endpoint import Teacher
from birdtrain.prompts import format_answer, parse_solution, single_turn_prompt

__all__ = [
    "TEACHER_SYSTEM_PROMPT",
    "build_reasoning_examples",
    "evidence_report",
    "offline_thought",
    "teacher_messages",
]

#: What the teacher is asked to do for a stage-1 thought.
TEACHER_SYSTEM_PROMPT = (
    "You write the reasoning of worked examples for training a SQL debugging assistant. You are "
    "given a user's issue, their problematic SQL, a fix known to be correct, and evidence from "
    "running both on the database. Write the reasoning an expert would go through to find that "
    "fix on their own: what the problematic SQL does, why that does not match the issue, and "
    "what must change. Never say or hint that the fix was given to you. Output only the "
    "reasoning as plain prose: no <thought> or <solution> tags and no final SQL block."
)

_MAX_CHANGES = 6


def _sentence(text: str) -> str:
    text = text.strip()
    return text[:1].upper() + text[1:] + ("" if text.endswith((".", "!", "?")) else ".")


def offline_thought(task: Task, evidence: Evidence, *, rows: int = 3) -> str:
    """A diagnosis told as a discovery, from the evidence only (no teacher).

    It reproduces the problem (the problematic SQL's real error, rows or changed rows), names
    the clauses and functions that must change, and checks the corrected SQL's real result.
    ``rows``: result rows quoted per statement (0: only their count and columns).
    """
    parts: list[str] = []
    runs = evidence.issue_runs
    if len(task.issue_sql) == 1 and runs:
        parts.append(
            "Let me first work out what the problematic SQL does on this database: "
            + summarize_run(runs[0], rows=rows)
            + "."
        )
    else:
        parts.append("Let me first work out what each problematic statement does.")
        for i, run in enumerate(runs, 1):
            parts.append(_sentence(f"statement {i}: {summarize_run(run, rows=rows)}"))
        if len(runs) < len(task.issue_sql):
            parts.append("The statements after the failing one never run.")
    if evidence.changes:
        shown = evidence.changes[:_MAX_CHANGES]
        more = len(evidence.changes) - len(shown)
        parts.append(
            "Reading the SQL against what the user asks for, this is where it goes wrong: "
            + "; ".join(shown)
            + (f"; and {more} smaller edits of the same kind" if more > 0 else "")
            + "."
        )
    if evidence.functions_added:
        parts.append(f"The corrected version needs {', '.join(evidence.functions_added)}.")
    if evidence.functions_removed:
        parts.append(f"It no longer needs {', '.join(evidence.functions_removed)}.")
    fixed = evidence.fix_runs
    if fixed:
        last = summarize_run(fixed[-1], rows=rows)
        if fixed[-1].error is None:
            parts.append(_sentence(f"with those changes, {last}"))
            before = runs[-1] if runs else None
            if before is not None and before.error is not None:
                parts.append("The error is gone.")
            elif (
                before is not None
                and before.columns
                and fixed[-1].columns
                and before.row_count != fixed[-1].row_count
            ):
                parts.append(
                    f"That is {fixed[-1].row_count} rows instead of {before.row_count}, "
                    "which is what the issue expects."
                )
            elif (
                before is not None
                and before.changed is not None
                and fixed[-1].changed not in (None, before.changed)
            ):
                parts.append(
                    f"That is {fixed[-1].changed} changed rows instead of {before.changed}."
                )
        else:
            parts.append(_sentence(f"the corrected SQL on this copy: {last}"))
    return " ".join(parts)


def evidence_report(task: Task, evidence: Evidence) -> str:
    """The evidence as a Markdown list, for the teacher."""
    lines = []
    for i, run in enumerate(evidence.issue_runs, 1):
        lines.append(f"- problematic statement {i}: {summarize_run(run, rows=5)}")
    for i, run in enumerate(evidence.fix_runs, 1):
        lines.append(f"- fixed statement {i}: {summarize_run(run, rows=5)}")
    for change in evidence.changes:
        lines.append(f"- syntax difference: {change}")
    if evidence.functions_added:
        lines.append(f"- functions the fix adds: {', '.join(evidence.functions_added)}")
    if evidence.functions_removed:
        lines.append(f"- functions the fix drops: {', '.join(evidence.functions_removed)}")
    if evidence.tables:
        lines.append(f"- tables the problematic SQL touches: {', '.join(evidence.tables)}")
    return "\n".join(lines)


def teacher_messages(task: Task, evidence: Evidence) -> list[dict[str, str]]:
    """The chat sent to the teacher for one stage-1 thought: the task, the fix and the evidence."""
    fix = "\n".join(f"```sql\n{sql}\n```" for sql in task.sol_sql)
    user = (
        f"{single_turn_prompt(task)}\n\n"
        f"# A correct fix (for you only; never mention that you were given it)\n{fix}\n\n"
        f"# Evidence from running the SQL on the database\n{evidence_report(task, evidence)}\n\n"
        "Write the reasoning that leads from the issue to this fix."
    )
    return [
        {"role": "system", "content": TEACHER_SYSTEM_PROMPT},
        {"role": "user", "content": user},
    ]


_TAGS = re.compile(r"</?thought>", re.IGNORECASE)


def _clean_teacher_thought(text: str) -> str:
    """The teacher's reply as a thought: its own tags, solution and thinking blocks removed."""
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL)
    text = re.split(r"<solution>", text, maxsplit=1)[0]
    return _TAGS.sub("", text).strip()


def build_reasoning_examples(
    tasks: Iterable[Task],
    *,
    teacher: Teacher | None = None,
    processes: int = 1,
    pool: ReplicaPool | None = None,
    teacher_params: dict[str, Any] | None = None,
    stats: dict[str, int] | None = None,
    progress: bool = True,
    prompt: PromptOptions | None = None,
    thought_rows: int = 3,
) -> list[dict[str, Any]]:
    """Stage-1 examples for ``tasks``: evidence-based thoughts, solutions the judge accepts.

    ``prompt``: how the prompts show the database (the run's one prompt setting).
    ``thought_rows``: result rows an offline thought quotes per statement (0: only their count
    and columns).

    ``teacher`` writes the thoughts when given (a :class:`TeacherError` propagates: a configured
    teacher that does not answer is an error, not a silent fallback); ``processes`` judges in
    parallel; ``pool`` leases the evidence sessions (default: the process's pool);
    ``teacher_params`` go into every teacher request (e.g. ``{"temperature": 0.2}``). ``stats``,
    when given, is filled with counts: ``tasks``, ``kept``, ``failed_judge``, ``no_fix``,
    ``preprocess_error``, ``empty_thought``.
    """
    # the train extra: imported only where used
    from tqdm.auto import tqdm

    pool = pool or default_pool()
    counts = {
        "tasks": 0,
        "kept": 0,
        "failed_judge": 0,
        "no_fix": 0,
        "preprocess_error": 0,
        "empty_thought": 0,
    }
    candidates: list[tuple[Task, dict[str, Any]]] = []
    task_list = list(tasks)
    for task in tqdm(task_list, desc="stage-1 thoughts", disable=not progress):
        counts["tasks"] += 1
        if not task.sol_sql:
            counts["no_fix"] += 1
            continue
        try:
            evidence = gather_evidence(task, pool)
        except PreprocessError:
            counts["preprocess_error"] += 1
            continue
        if teacher is not None:
            reply = teacher.chat(teacher_messages(task, evidence), **(teacher_params or {}))
            thought = _clean_teacher_thought(reply)
        else:
            thought = offline_thought(task, evidence, rows=thought_rows)
        if not thought:
            counts["empty_thought"] += 1
            continue
        example = {
            "prompt": [{"role": "user", "content": single_turn_prompt(task, prompt)}],
            "completion": [{"role": "assistant", "content": format_answer(thought, task.sol_sql)}],
            "task_id": task.instance_id,
        }
        candidates.append((task, example))
    # Judge what a model trained on the example would be scored on: the parsed answer.
    jobs = [(task, parse_solution(ex["completion"][0]["content"])) for task, ex in candidates]
    examples = []
    for (_, example), verdict in zip(
        candidates,
        score_many(jobs, processes=processes),
        strict=True,  # each by its dialect's judge
    ):
        if verdict.passed:
            examples.append(example)
        else:
            counts["failed_judge"] += 1
    counts["kept"] = len(examples)
    if stats is not None:
        stats.update(counts)
    return examples

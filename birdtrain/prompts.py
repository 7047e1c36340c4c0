"""The single-turn prompt and answer format (stages 1 and 3, single-turn evaluation).

A single-turn prompt is one user message: the database schema (the benchmark's rendering, CREATE
statements plus three rows per table), the user's issue, the problematic SQL, and the answer
format; for a BIRD question (:class:`birdenv.tasks.BirdTask`), the schema, the question, its
external knowledge and the same answer format, the last statement of the solution being the
answer. The task's own sections come from the task (:meth:`birdenv.tasks.BaseTask.prompt_sections`). The answer is::

    <thought>
    ...diagnosis...
    </thought>
    <solution>
    ```sql
    first statement
    ```
    ```sql
    second statement
    ```
    </solution>

Every ```sql block of the solution is one element of ``pred_sqls``, exactly as the benchmark's
baseline reads answers. Everything that writes or reads this format goes through this module.

A checkpoint saved by a training stage records the prompt setting it was trained on
(:func:`record_prompt`), so that an evaluation of it reads its tasks the same way by default
(:func:`prompt_for`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from birdenv.schema import PromptOptions, task_schema
from birdenv.tasks import BaseTask

__all__ = [
    "ANSWER_INSTRUCTIONS",
    "PROMPT_RECORD",
    "format_answer",
    "parse_solution",
    "prompt_for",
    "record_prompt",
    "recorded_prompt",
    "single_turn_prompt",
]

#: The file in a checkpoint's folder that holds the prompt setting the checkpoint was trained on.
PROMPT_RECORD = "birdtrain_prompt.json"

#: The last part of every single-turn prompt: how to answer.
ANSWER_INSTRUCTIONS = """# Answer format
First reason about the problem inside <thought>...</thought>. Then give the corrected SQL inside <solution>...</solution>, with each statement in its own ```sql block; the statements run in order, one statement per block."""

_PROMPT = """You are a SQL assistant. Your task is to {goal}.

# Database Schema:
{schema}

{sections}

{instructions}"""

_SOLUTION = re.compile(r"<solution>(.*?)(?:</solution>|\Z)", re.DOTALL)
# ```sql ... ``` (the language tag is optional and case-insensitive: models write ```SQL too).
_BLOCK = re.compile(r"```[ \t]*(?:sql|sqlite)?[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


def single_turn_prompt(task: BaseTask, options: PromptOptions | None = None) -> str:
    """The user message of a single-turn task: schema, issue, problematic SQL, answer format.

    For a BIRD question: schema, question, external knowledge ("(none)" when empty), answer format.
    ``options`` say how the schema reads (:class:`birdenv.schema.PromptOptions`; default: the
    benchmark's full form with three rows per table), as in the environments' prompts.
    """
    return _PROMPT.format(
        goal=task.goal,
        schema=task_schema(task, options),
        sections=task.prompt_text(),
        instructions=ANSWER_INSTRUCTIONS,
    )


def parse_solution(text: str) -> list[str]:
    """The SQL statements of an answer's ``<solution>``: one per ```sql block.

    The last ``<solution>`` counts (a model may quote the format while thinking); an unclosed one
    runs to the end of the text, so an answer cut by the length limit still yields its blocks.
    Without blocks, the stripped solution text itself is the one statement; without a
    ``<solution>`` there is no answer.

    >>> parse_solution("<thought>x</thought>\\n<solution>\\n```sql\\nSELECT 1\\n```\\n```sql\\nSELECT 2;\\n```\\n</solution>")
    ['SELECT 1', 'SELECT 2;']
    >>> parse_solution("<solution>SELECT 1</solution>")
    ['SELECT 1']
    >>> parse_solution("no answer here")
    []
    """
    found = _SOLUTION.findall(text)
    if not found:
        return []
    body = found[-1]
    blocks = [block.strip() for block in _BLOCK.findall(body)]
    if blocks:
        return [block for block in blocks if block]
    body = body.strip()
    return [body] if body else []


def format_answer(thought: str, sql_list: list[str]) -> str:
    """An answer in the format :func:`parse_solution` reads back.

    >>> answer = format_answer("The filter compares with NULL.", ["SELECT 1", "SELECT 2"])
    >>> print(answer)
    <thought>
    The filter compares with NULL.
    </thought>
    <solution>
    ```sql
    SELECT 1
    ```
    ```sql
    SELECT 2
    ```
    </solution>
    >>> parse_solution(answer)
    ['SELECT 1', 'SELECT 2']
    """
    blocks = "\n".join(f"```sql\n{sql.strip()}\n```" for sql in sql_list)
    return f"<thought>\n{thought.strip()}\n</thought>\n<solution>\n{blocks}\n</solution>"


def record_prompt(checkpoint: str | Path, options: PromptOptions) -> Path:
    """Write ``options`` into the checkpoint folder ``checkpoint`` (:data:`PROMPT_RECORD`)."""
    path = Path(checkpoint) / PROMPT_RECORD
    path.write_text(json.dumps(dataclasses.asdict(options)) + "\n", encoding="utf-8")
    return path


def recorded_prompt(model: str | Path) -> PromptOptions | None:
    """The prompt setting a checkpoint folder records; None for anything else (a model name, a
    hub id, a checkpoint saved without one). A record that does not parse is an error, not a
    silent fall-back to another prompt."""
    path = Path(model).expanduser() / PROMPT_RECORD
    if not path.is_file():
        return None
    try:
        return PromptOptions.of(json.loads(path.read_text(encoding="utf-8")))
    except ValueError as exc:  # json.JSONDecodeError and SchemaError both
        raise ValueError(f"{path}: not a prompt setting ({exc})") from None


def prompt_for(
    model: str | Path, given: PromptOptions | Mapping[str, Any] | None = None
) -> PromptOptions:
    """The prompt setting to evaluate ``model`` with.

    ``given`` options are used as they are; a mapping (e.g. the options a command line named)
    overrides only its own keys of the checkpoint's recorded setting (:func:`recorded_prompt`);
    without either, the checkpoint's setting, else the benchmark's full form.

    >>> prompt_for("tiny", {"schema": "linked"})
    PromptOptions(schema='linked', sample_rows=True)
    """
    if isinstance(given, PromptOptions):
        return given
    recorded = recorded_prompt(model) or PromptOptions()
    return PromptOptions.of({**dataclasses.asdict(recorded), **(given or {})})

"""The tool protocol: the two tools, their JSON schemas, parsing a model's turn, and the one
observation formatter.

Data synthesis, training, evaluation and inference all go through this module, so a model sees in
training exactly what it sees at test time. A turn calls one tool in the format chat templates and
TRL use::

    <tool_call>{"name": "execute_sql", "arguments": {"sql": "SELECT 1"}}</tool_call>

Text outside the call (reasoning) is allowed. A turn without ``<tool_call>`` tags whose one
fenced JSON code block holds the call (```` ```json {"name": ..., "arguments": ...} ``` ````, as
Qwen2.5-Coder-Instruct writes its calls) is read as that call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Sequence
from json.decoder import JSONDecoder
from typing import Any

from birdenv.dialects import dialect_of
from birdenv.errors import BirdEnvError
from birdenv.replicas.session import Result

__all__ = [
    "MAX_CELL_CHARS",
    "MAX_SHOWN_ROWS",
    "TOOL_SCHEMAS",
    "ToolCall",
    "ToolCallError",
    "execute_sql",
    "format_observation",
    "format_tool_call",
    "format_verdict",
    "has_tool_call",
    "parse_tool_call",
    "submit_solution",
    "tool_instructions",
]

#: Rows of a result shown to the model; the total count is always reported.
MAX_SHOWN_ROWS = 20
#: Characters of one cell shown to the model.
MAX_CELL_CHARS = 100
# The whole observation is cut here, with a notice, so one result cannot flood the context.
_MAX_OBSERVATION_CHARS = 6000


def execute_sql(sql: str) -> str:
    """Run one SQL statement on your own copy of the database and see its result.

    Your changes (tables, rows, TEMP objects, settings) persist across your turns and nobody else
    sees them. The submitted solution is judged on a fresh copy.

    Args:
        sql: Exactly one SQL statement, in the database's dialect.
    """
    raise NotImplementedError("a tool signature: the environment executes it")


def submit_solution(sql_list: list[str]) -> str:
    """Submit your final fix. It is run on a fresh copy of the database and judged; the episode ends.

    Args:
        sql_list: The corrected SQL statements, one statement per string, run in order.
    """
    raise NotImplementedError("a tool signature: the environment executes it")


# Exactly what transformers.utils.get_json_schema renders for the two functions above (a test
# checks it), written out so that birdenv does not import transformers.
TOOL_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "execute_sql",
            "description": "Run one SQL statement on your own copy of the database and see its result.\n\n"
            "Your changes (tables, rows, TEMP objects, settings) persist across your turns and nobody else\n"
            "sees them. The submitted solution is judged on a fresh copy.",
            "parameters": {
                "type": "object",
                "properties": {
                    "sql": {
                        "type": "string",
                        "description": "Exactly one SQL statement, in the database's dialect.",
                    }
                },
                "required": ["sql"],
            },
            "return": {"type": "string"},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit_solution",
            "description": "Submit your final fix. It is run on a fresh copy of the database and judged; the episode ends.",
            "parameters": {
                "type": "object",
                "properties": {
                    "sql_list": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "The corrected SQL statements, one statement per string, run in order.",
                    }
                },
                "required": ["sql_list"],
            },
            "return": {"type": "string"},
        },
    },
]

_TOOL_INSTRUCTIONS = """# Tools
You work on your own copy of this database. Each turn, think if you like, then call exactly one tool:
- execute_sql(sql): run one {dialect} statement and see its result; your changes persist across turns.
- submit_solution(sql_list): submit the corrected SQL statements (one statement per string); this ends the task.
Call a tool like this:
<tool_call>{{"name": "execute_sql", "arguments": {{"sql": "SELECT ..."}}}}</tool_call>
<tool_call>{{"name": "submit_solution", "arguments": {{"sql_list": ["..."]}}}}</tool_call>"""


def tool_instructions(dialect: str = "SQLite") -> str:
    """The prompt's tool section for a database of ``dialect`` (``"sqlite"``, ``"PostgreSQL"``,
    ...): the two tools and how to call them."""
    return _TOOL_INSTRUCTIONS.format(dialect=dialect_of(dialect).title)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PARAMETERS = {"execute_sql": ("sql", str), "submit_solution": ("sql_list", list)}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: ``name`` and its validated ``arguments``."""

    name: str
    arguments: dict[str, Any]


class ToolCallError(BirdEnvError, ValueError):
    """A turn's tool call could not be understood; the message is shown to the model."""


def format_tool_call(name: str, **arguments: Any) -> str:
    """The text of a tool call, for scripted agents and synthetic data.

    >>> format_tool_call("execute_sql", sql="SELECT 1")
    '<tool_call>{"name": "execute_sql", "arguments": {"sql": "SELECT 1"}}</tool_call>'
    """
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}</tool_call>"


def _blocks(text: str) -> list[str]:
    """The text inside each ``<tool_call>…</tool_call>``, left to right, each closed by the first
    ``</tool_call>`` after its opening (what ``<tool_call>(.*?)</tool_call>`` finds, in a third of
    the time on a typical turn)."""
    blocks = []
    start = text.find(_OPEN)
    while start >= 0:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            break
        blocks.append(text[start + len(_OPEN) : end])
        start = text.find(_OPEN, end + len(_CLOSE))
    return blocks


def _tagged(text: str) -> str:
    """``text``, or, when it has no ``<tool_call>`` tag and fenced JSON code blocks
    (```` ```json ```` or ```` ``` ````, then an object), each block's object between the tags:
    instruct models trained on code write their calls so (Qwen2.5-Coder-1.5B-Instruct wrote every
    one of 72 opening turns so), and a call they meant is read as the call it is. Several such
    blocks are several calls, each between its own tags, so that the turn is refused for what it
    is (two calls in one turn, not none); tags, where present, rule. Linear in the text (no
    pattern that backtracks over a hostile turn full of fences)."""
    if _OPEN in text or "```" not in text:
        return text
    fenced = [
        body
        for block in text.split("```")[1:-1:2]  # the insides of complete fences
        if (body := block.removeprefix("json").strip()).startswith("{") and body.endswith("}")
    ]
    return "".join(f"{_OPEN}{body}{_CLOSE}" for body in fenced) or text


def parse_tool_call(text: str) -> ToolCall:
    """Parse the single tool call of a turn, or raise :class:`ToolCallError` saying what is wrong."""
    return _parse(_tagged(text))


def _parse_tool_call(text: str) -> ToolCall:
    """The rule of :func:`parse_tool_call` (``birdenv._speedups`` runs the same in C)."""
    blocks = _blocks(text)
    if not blocks:
        hint = " (found <tool_call> without </tool_call>)" if _OPEN in text else ""
        raise ToolCallError(f"no tool call found{hint}; call exactly one tool per turn")
    if len(blocks) > 1:
        raise ToolCallError(f"{len(blocks)} tool calls in one turn; call exactly one tool per turn")
    try:
        call = json.loads(blocks[0])
    except json.JSONDecodeError as exc:
        raise ToolCallError(
            # (json's message for a control character already ends in "at")
            f"the tool call is not valid JSON: {exc.msg.removesuffix(' at')} at char {exc.pos}"
        ) from None
    except RecursionError:
        raise ToolCallError("the tool call is not valid JSON: nested too deeply") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = call["name"]
    if name not in _PARAMETERS:
        raise ToolCallError(f"unknown tool {name!r}; the tools are execute_sql and submit_solution")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the arguments JSON-encoded twice
        with contextlib.suppress(json.JSONDecodeError, RecursionError):
            arguments = json.loads(arguments)
    key, expected = _PARAMETERS[name]
    if not isinstance(arguments, dict) or len(arguments) != 1 or key not in arguments:
        raise ToolCallError(f"{name} takes exactly one argument, {key!r}")
    value = arguments[key]
    if expected is str and not isinstance(value, str):
        raise ToolCallError(f"{name}: {key!r} must be a string")
    if expected is list and (
        not isinstance(value, list) or not all(isinstance(s, str) for s in value)
    ):
        raise ToolCallError(f"{name}: {key!r} must be a list of SQL strings")
    return ToolCall(name, {key: value})


def has_tool_call(text: str) -> bool:
    """True when a turn holds a tool call that :func:`parse_tool_call` accepts.

    >>> has_tool_call(format_tool_call("execute_sql", sql="SELECT 1")), has_tool_call("SELECT 1")
    (True, False)
    """
    try:
        parse_tool_call(text)
    except ToolCallError:
        return False
    return True


def _cell(value: Any) -> str:
    cls = type(value)
    # The common types first, by exact type: this runs for every value shown in every step.
    if cls is str:
        text = value
        if "\n" in text or "|" in text:
            text = text.replace("\n", "\\n").replace("|", "\\|")
    elif cls is int:
        text = str(value)  # no newline or bar to escape
    elif value is None:
        return "NULL"
    elif isinstance(value, bytes):
        return f"<blob {len(value)} bytes>"
    elif isinstance(value, float):
        return f"{value:.10g}"  # 4359.043999999998 -> 4359.044: float noise helps nobody
    else:
        text = str(value).replace("\n", "\\n").replace("|", "\\|")
    return text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 3] + "..."


def _table(columns: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """The header line and one line per row, ``| a | b |``, joined by newlines."""
    return "\n".join("| " + " | ".join(map(_cell, line)) + " |" for line in (columns, *rows))


# The table and the parser in C (birdenv/_speedups.c): a step's formatting in a quarter of the
# time, its parsing in an eighth; tests check that both give what the rules above give. Without a C
# compiler at install time the rules run themselves (`birdenv doctor` says which).
try:
    from birdenv import _speedups
except ImportError as exc:
    #: Why the C table formatter and parser are not in use (for ``birdenv doctor``), or None.
    SPEEDUPS_MISSING: str | None = f"the C extension birdenv._speedups is not built ({exc})"
    _render_table, _parse = _table, _parse_tool_call
else:
    SPEEDUPS_MISSING = None
    _speedups.configure(
        ToolCall,
        ToolCallError,
        JSONDecoder().scan_once,
        json.decoder.scanstring,
        json.JSONDecodeError,
        MAX_CELL_CHARS,
    )
    _render_table, _parse = _speedups.table, _speedups.parse_tool_call


def format_observation(result: Result) -> str:
    """The observation of an ``execute_sql`` call: status, columns, the first rows, counts, notices."""
    if result.error is not None:
        return f"status: error\nerror: {result.error}"
    if not result.columns:
        return "status: ok\nstatement executed; no rows returned"
    shown = result.rows[:MAX_SHOWN_ROWS]
    more = "+" if result.truncated else ""
    showing = f" (showing first {len(shown)})" if len(shown) < len(result.rows) else ""
    table = _render_table(result.columns, shown)
    text = f"status: ok\nrows: {len(result.rows)}{more}{showing}\n{table}"
    if result.truncated:
        text += "\nnote: the result was cut at the row or size limit; add LIMIT or aggregate"
    if len(text) > _MAX_OBSERVATION_CHARS:
        text = text[:_MAX_OBSERVATION_CHARS] + "\n[observation cut at 6000 characters]"
    return text


def format_verdict(verdict: Any) -> str:
    """The observation after ``submit_solution``: the judge's verdict in one or two lines."""
    head = f"verdict: {verdict.status} ({verdict.tests_passed}/{verdict.tests_total} tests passed)"
    return head if verdict.passed or not verdict.error else f"{head}\n{verdict.error[:1000]}"

"""The tool protocol: parsing a model's turn and the one observation formatter."""

from __future__ import annotations

import json
import re

import pytest
from c_extensions import c_extension
from hypothesis import given, settings
from hypothesis import strategies as st

from birdenv.replicas.session import Result
from birdenv.tools import (
    TOOL_SCHEMAS,
    ToolCallError,
    execute_sql,
    format_observation,
    format_tool_call,
    has_tool_call,
    parse_tool_call,
    submit_solution,
)
from birdenv.tools import _blocks as tool_call_blocks


def test_round_trip_with_reasoning_around_the_call() -> None:
    text = "Let me look.\n" + format_tool_call(
        "submit_solution", sql_list=["SELECT 'é'", "SELECT 2"]
    )
    call = parse_tool_call(text)
    assert call.name == "submit_solution" and call.arguments == {
        "sql_list": ["SELECT 'é'", "SELECT 2"]
    }


# How Qwen2.5-Coder-1.5B-Instruct wrote every opening turn of its first evaluation (72 of 72).
CODER_CALL = """```json
{
  "name": "execute_sql",
  "arguments": {
    "sql": "SELECT u.country, COUNT(*) FROM ratings r JOIN users u USING (user_id) GROUP BY 1"
  }
}
```"""


def test_a_call_in_one_fenced_json_block_is_that_call() -> None:
    sql = "SELECT u.country, COUNT(*) FROM ratings r JOIN users u USING (user_id) GROUP BY 1"
    assert parse_tool_call(CODER_CALL) == parse_tool_call(format_tool_call("execute_sql", sql=sql))
    bare = (
        'I submit.\n```\n{"name": "submit_solution", "arguments": {"sql_list": ["SELECT 1"]}}\n```'
    )
    assert parse_tool_call(bare).arguments == {"sql_list": ["SELECT 1"]}
    # Tags rule where present: the fenced block beside them is prose.
    tagged = CODER_CALL + "\n" + format_tool_call("execute_sql", sql="SELECT 2")
    assert parse_tool_call(tagged).arguments == {"sql": "SELECT 2"}
    assert has_tool_call(CODER_CALL) and not has_tool_call("```sql\nSELECT 1\n```")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("just prose", "no tool call"),
        # Two fenced calls are two calls, and the model is told so (not that it made none).
        (f"I run it, then submit.\n{CODER_CALL}\nThen:\n{CODER_CALL}", "^2 tool calls in one turn"),
        ("```sql\nSELECT 1\n```", "no tool call"),
        ('```json\n{"name": "drop_db", "arguments": {}}\n```', "unknown tool"),
        ("<tool_call>{}", "without </tool_call>"),
        ("<tool_call>{bad json}</tool_call>", "not valid JSON"),
        (
            '<tool_call>{"name": "execute_sql", "arguments": {"sql": "SELECT\n1"}}</tool_call>',
            r"not valid JSON: Invalid control character at char 52$",
        ),
        (format_tool_call("execute_sql", sql="1") * 2, "2 tool calls"),
        (format_tool_call("drop_db", sql="1"), "unknown tool"),
        (format_tool_call("execute_sql", sql=5), "must be a string"),
        (format_tool_call("execute_sql", query="SELECT 1"), "exactly one argument"),
        (format_tool_call("submit_solution", sql_list="SELECT 1"), "list of SQL strings"),
        ('<tool_call>["execute_sql"]</tool_call>', "JSON object"),
    ],
)
def test_bad_calls_explain_themselves(text: str, message: str) -> None:
    with pytest.raises(ToolCallError, match=message):
        parse_tool_call(text)


def test_observation_shows_status_columns_rows_and_truncation() -> None:
    rows = [(i, f"name {i}", None, 0.1 + 0.2) for i in range(25)]
    text = format_observation(Result(["id", "name", "city", "x"], rows, 25, True, None, 0.01))
    lines = text.splitlines()
    assert lines[0] == "status: ok"
    assert lines[1] == "rows: 25+ (showing first 20)"
    assert lines[2] == "| id | name | city | x |"
    assert lines[3] == "| 0 | name 0 | NULL | 0.3 |"
    assert "cut at the row or size limit" in lines[-1]
    error = format_observation(Result([], [], -1, False, "no such table: t", 0.0))
    assert error == "status: error\nerror: no such table: t"


@given(
    st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "call>", "x", "\n", "{}"]))
)
def test_tool_call_blocks_are_what_the_pattern_finds(pieces: list[str]) -> None:
    text = "".join(pieces)
    assert tool_call_blocks(text) == re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)


@pytest.mark.parametrize(
    ("value", "cell"),
    [
        (None, "NULL"),
        (-42, "-42"),
        (10**120, "1" + "0" * 96 + "..."),
        (True, "True"),
        (0.1 + 0.2, "0.3"),
        (b"\x00\x01", "<blob 2 bytes>"),
        ("a|b\nc", "a\\|b\\nc"),
        ("é" * 100, "é" * 100),
        ("x" * 101, "x" * 97 + "..."),
        ("|" * 60, "\\|" * 48 + "\\..."),
        (type("Text", (str,), {})("sub|class"), "sub\\|class"),
        (bytearray(b"ab"), "bytearray(b'ab')"),
    ],
)
def test_observation_cells(value: object, cell: str) -> None:
    text = format_observation(Result(["v"], [(value,)], 1, False, None, 0.0))
    assert text.splitlines()[3] == f"| {cell} |"


def test_schemas_match_transformers_get_json_schema() -> None:
    utils = pytest.importorskip("transformers.utils", reason="transformers is in the train extra")
    assert [
        utils.get_json_schema(execute_sql),
        utils.get_json_schema(submit_solution),
    ] == TOOL_SCHEMAS


# Every kind of value a result can hold, and others a caller might pass: text with the characters
# the formatter escapes and cuts, numbers at their edges, blobs, subclasses, objects of their own.
_VALUES = st.one_of(
    st.none(),
    st.text(alphabet=st.sampled_from("ab|\n\\é\x00 \U0001f600"), max_size=130),
    st.text(max_size=40),
    st.text(alphabet="x", min_size=97, max_size=103),  # about the cut
    st.integers(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.binary(max_size=20),
    st.booleans(),
    st.builds(bytearray, st.binary(max_size=5)),
    st.builds(type("Text", (str,), {}), st.text(alphabet="x|\n", max_size=110)),
    st.builds(type("Whole", (int,), {}), st.integers()),
    st.builds(type("Real", (float,), {}), st.floats()),
    st.decimals(allow_nan=False),
)


@given(
    columns=st.lists(st.text(alphabet="ab|\n", max_size=105), max_size=4),
    rows=st.lists(st.tuples(_VALUES, _VALUES, _VALUES) | st.lists(_VALUES, max_size=4), max_size=5),
)
def test_the_c_table_is_the_rule(columns: list[str], rows: list) -> None:
    """``birdenv._speedups.table``, which formats every step's result, gives exactly the text of
    the rule in ``birdenv.tools`` (``_cell`` per value), and raises what it raises."""
    speedups = c_extension("birdenv._speedups")
    from birdenv import tools

    assert tools._render_table is speedups.table  # what format_observation uses
    assert speedups.table(columns, rows) == tools._table(columns, rows)


@given(
    rows=st.lists(st.tuples(_VALUES, _VALUES, _VALUES) | st.lists(_VALUES, max_size=4), max_size=5)
)
def test_the_c_byte_count_is_the_rule(rows: list) -> None:
    """``birdenv.replicas.native._sizes.batch_bytes``, which counts every batch a session fetches against its
    byte cap, counts what the rule counts: ``length_hint(value, 8)`` a value, 8 a row."""
    sizes = c_extension("birdenv.replicas.native._sizes")
    from birdenv.replicas import session

    assert session._batch_bytes is sizes.batch_bytes  # what fetch_capped uses
    expected = sum(session._row_bytes(tuple(row)) for row in rows)
    assert sizes.batch_bytes(rows) == session._rows_bytes(rows) == expected
    assert sizes.batch_bytes(tuple(rows)) == expected


def test_the_c_byte_count_raises_what_the_rule_raises() -> None:
    sizes = c_extension("birdenv.replicas.native._sizes")
    from birdenv.replicas import session

    class Unmeasurable:
        def __length_hint__(self) -> int:
            raise RuntimeError("no size")

    for rows in ([5], [(Unmeasurable(),)], None):
        with pytest.raises((RuntimeError, TypeError)) as c_error:
            sizes.batch_bytes(rows)
        with pytest.raises(type(c_error.value)):
            session._rows_bytes(rows)


def test_the_c_table_raises_what_the_rule_raises() -> None:
    speedups = c_extension("birdenv._speedups")
    from birdenv import tools

    class Broken:
        def __str__(self) -> str:
            raise RuntimeError("no text")

    for rows in ([(1, Broken())], [5], None):
        with pytest.raises((RuntimeError, TypeError)) as c_error:
            speedups.table(["a"], rows)
        with pytest.raises(type(c_error.value)):
            tools._table(["a"], rows)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_NAMES = st.sampled_from(["execute_sql", "submit_solution"] * 3 + ["run_sql", ""]) | st.text(
    max_size=5
)
_ARGUMENTS = st.one_of(
    st.fixed_dictionaries({"sql": st.text(max_size=10)}),
    st.fixed_dictionaries({"sql_list": st.lists(st.text(max_size=5), max_size=3)}),
    st.fixed_dictionaries({"sql_list": st.lists(_JSON, max_size=2)}),
    st.dictionaries(st.sampled_from(["sql", "sql_list", "x"]), _JSON, max_size=2),
    _JSON,
)


@st.composite
def _turns(draw: st.DrawFn) -> str:
    """Turns as models write them, right or broken: reasoning, zero to three blocks (some not
    closed), calls whose name, arguments (some JSON-encoded twice) or JSON is wrong, whitespace,
    a byte-order mark, control characters, trailing data, nesting too deep for the decoder."""
    if draw(st.integers(0, 3)) == 0:  # a good call, as most turns hold
        call = draw(
            st.one_of(
                st.builds(lambda sql: ("execute_sql", {"sql": sql}), st.text(max_size=30)),
                st.builds(
                    lambda sqls: ("submit_solution", {"sql_list": sqls}),
                    st.lists(st.text(max_size=10), max_size=3),
                ),
            )
        )
        return draw(st.text(max_size=6)) + format_tool_call(call[0], **call[1])
    parts = []
    for _ in range(draw(st.sampled_from([1, 1, 1, 0, 2, 3]))):
        call = {"name": draw(_NAMES), "arguments": draw(_ARGUMENTS)}
        if draw(st.booleans()):
            call["arguments"] = json.dumps(call["arguments"])
        if draw(st.integers(0, 5)) == 0:
            call = draw(_JSON)
        body = json.dumps(call, ensure_ascii=draw(st.booleans()))
        body = draw(
            st.sampled_from(
                [
                    body,
                    body,
                    body,
                    f" \n\t{body}\r\n",
                    body[: draw(st.integers(0, len(body)))],  # cut anywhere
                    body + draw(st.sampled_from(["}", " x", "\x00", ""])),
                    "\ufeff" + body,
                    body.replace('"', "'"),
                    body.replace(" ", "\n"),  # control characters inside strings
                    "[" * 3000 + "]" * 3000,
                ]
            )
        )
        close = draw(st.sampled_from(["</tool_call>"] * 4 + ["", "</tool_call"]))
        parts.append(draw(st.text(max_size=6)) + "<tool_call>" + body + close)
    return "".join(parts) + draw(st.text(max_size=6))


def _outcome(parse, text: str) -> object:
    """What ``parse`` makes of ``text``: its call, or its ToolCallError's message."""
    try:
        return parse(text)
    except ToolCallError as exc:
        return ("error", str(exc))


@settings(max_examples=600)  # microseconds each; the variants of a broken call are many
@given(_turns())
def test_the_c_parser_is_the_rule(text: str) -> None:
    """``birdenv._speedups.parse_tool_call``, which parses every step's turn, returns the rule's
    call or raises its ToolCallError with the same message, whatever the turn."""
    speedups = c_extension("birdenv._speedups")
    from birdenv import tools

    assert tools._parse is speedups.parse_tool_call  # what parse_tool_call uses
    assert _outcome(speedups.parse_tool_call, text) == _outcome(tools._parse_tool_call, text)


@settings(max_examples=400)
@given(
    sql=st.text() | st.sampled_from(['"}}', "\\", "\ud800x", "a\x00b", "\u2028", "}}", ""]),
    ascii_only=st.booleans(),
    tail=st.sampled_from(["", "", "", "}", " ", "x", "\n", "}}"]),
)
def test_the_c_parser_reads_calls_as_written_like_the_rule(
    sql: str, ascii_only: bool, tail: str
) -> None:
    """The canonical ``execute_sql`` call, as ``format_tool_call`` writes it (the C parser's
    short path), and the same with anything after it in the block: the rule's outcome."""
    speedups = c_extension("birdenv._speedups")
    from birdenv import tools

    body = json.dumps({"name": "execute_sql", "arguments": {"sql": sql}}, ensure_ascii=ascii_only)
    text = f"<tool_call>{body}{tail}</tool_call>"
    assert _outcome(speedups.parse_tool_call, text) == _outcome(tools._parse_tool_call, text)
    if not tail:
        assert speedups.parse_tool_call(text).arguments == {"sql": sql}


def test_without_the_c_extension_the_rules_run_themselves() -> None:
    """An install without a C compiler parses and formats with the rules in ``birdenv.tools``,
    and says so."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["birdenv._speedups"] = None  # what a build without a compiler leaves: no module
from birdenv import tools
from birdenv.replicas.session import Result
assert tools._parse is tools._parse_tool_call and tools._render_table is tools._table
call = tools.parse_tool_call(tools.format_tool_call("execute_sql", sql="SELECT 1"))
print(tools.SPEEDUPS_MISSING)
print(call.arguments["sql"])
print(tools.format_observation(Result(["a"], [(None,)], 1, False, None, 0.0)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("the C extension birdenv._speedups is not built")
    assert lines[1:] == ["SELECT 1", "status: ok", "rows: 1", "| a |", "| NULL |"]


def test_without_the_c_byte_count_the_rule_counts() -> None:
    """An install without a C compiler counts a fetched batch's bytes with the session's rule."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["birdenv.replicas.native._sizes"] = None  # what a build without a compiler leaves
from birdenv.replicas import session
assert session._batch_bytes is session._rows_bytes
print(session._batch_bytes([("abc", None), (b"12",)]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["29"]

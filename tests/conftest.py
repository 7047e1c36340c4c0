"""Shared fixtures: small real SQLite databases in the official layout, replica pools, and a
strict OpenAI-compatible chat endpoint on loopback."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

# Ray tests run inside a private network namespace: hooks and the cluster fixture live there.
from private_network import (  # noqa: F401
    pytest_runtest_makereport,
    pytest_runtest_protocol,
    ray_cluster,
)

from birdenv.replicas import ReplicaPool, overlay
from birdenv.tasks import load_tasks
from birdenv.tools import ToolCallError, parse_tool_call

SHOP_SQL = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT, joined TEXT);
CREATE TABLE orders (
    id INTEGER PRIMARY KEY,
    customer_id INTEGER REFERENCES customers(id) ON DELETE CASCADE,
    placed_at TEXT NOT NULL,
    total REAL
);
CREATE VIEW big_orders AS SELECT * FROM orders WHERE total > 100;
INSERT INTO customers VALUES (1, 'Ann', 'Paris', '2021-01-05'), (2, 'Bob', NULL, '2021-02-11'),
    (3, 'Cid', 'Rome', '2022-07-30');
INSERT INTO orders VALUES (1, 1, '2023-01-01 10:00:00', 120.5), (2, 1, '2023-01-03 09:30:00', 80.0),
    (3, 2, '2023-02-01 12:00:00', NULL), (4, 3, '2023-02-15 18:45:00', 300.25);
"""


def build_shop(db_dir: Path) -> Path:
    """Build the small ``shop`` database at ``{db_dir}/shop/shop_template.sqlite``."""
    path = db_dir / "shop" / "shop_template.sqlite"
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    conn.executescript(SHOP_SQL)
    conn.close()
    return path


SHOP_TASKS = [
    {
        "instance_id": "shop_1",
        "db_id": "shop",
        "category": "Query",
        "query": "Customers without a city should be listed, but my query returns nothing.",
        "issue_sql": ["SELECT name FROM customers WHERE city = NULL"],
        "sol_sql": ["SELECT name FROM customers WHERE city IS NULL"],
    },
    {
        "instance_id": "shop_2",
        "db_id": "shop",
        "category": "Management",
        "query": "Orders with no total should count as 0; my update changes nothing.",
        "issue_sql": ["UPDATE orders SET total = 0 WHERE total = NULL"],
        "sol_sql": ["UPDATE orders SET total = 0 WHERE total IS NULL"],
        "test_cases": [
            "def test_case(pred_sqls, sol_sqls, db_path, conn, conditions):\n"
            "    res, err, to = execute_queries(['SELECT count(*) FROM orders WHERE total IS NULL'], db_path, conn, None, '')\n"
            "    assert not err and res[0][0] == 0, res\n"
            "    return 1\n"
        ],
    },
    {
        "instance_id": "shop_3",
        "db_id": "shop",
        "category": "Personalization",
        "query": "Totals per customer, biggest first.",
        "preprocess_sql": ["INSERT INTO orders VALUES (5, 2, '2023-03-01 08:00:00', 10.0)"],
        "issue_sql": ["SELECT customer_id, SUM(total) FROM orders GROUP BY customer_id ORDER BY 2"],
        "sol_sql": [
            "SELECT customer_id, SUM(total) FROM orders GROUP BY customer_id ORDER BY 2 DESC"
        ],
        "conditions": {"order": True},
    },
]


def open_on(path: Path) -> int:
    """How many of this process's descriptors are open on ``path``."""
    target = str(path.resolve())
    fds = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
    return sum(os.path.realpath(fd) == target for fd in fds if os.path.exists(fd))


@pytest.fixture
def shop_dir(tmp_path: Path) -> Path:
    """A database directory in the official layout holding the ``shop`` database."""
    db_dir = tmp_path / "dbs"
    build_shop(db_dir)
    return db_dir


@pytest.fixture
def shop_tasks(shop_dir: Path, tmp_path: Path) -> list:
    """The ``shop`` tasks, loaded from a JSONL file through the public loader."""
    path = tmp_path / "shop.jsonl"
    path.write_text("\n".join(json.dumps(t) for t in SHOP_TASKS) + "\n")
    return load_tasks(path, db_dir=shop_dir)


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Any]:
    """``mount_tmpfs(size)``: a tmpfs of ``size`` (e.g. ``"6m"``) mounted under ``tmp_path`` for
    the test, to fill a disk (needs root); the test is skipped where mounting is not allowed."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        path = tmp_path / f"tmpfs-{len(mounts)}"
        path.mkdir()
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            pytest.skip(
                f"cannot mount a small tmpfs here ({proc.stderr.strip() or proc.returncode})"
            )
        mounts.append(path)
        return path

    try:
        yield mount
    finally:
        for path in mounts:
            subprocess.run(["umount", "-l", str(path)], check=False)


def _strategies() -> list:
    reason = None if overlay.available() else overlay.unavailable_reason()
    return [
        "copy",
        pytest.param("overlay", marks=pytest.mark.skipif(reason is not None, reason=str(reason))),
    ]


@pytest.fixture(params=_strategies())
def pool(request: pytest.FixtureRequest, tmp_path: Path):
    """A replica pool on a private root, once per available strategy."""
    with ReplicaPool(root=tmp_path / "replicas", strategy=request.param) as p:
        yield p


# -- PostgreSQL: the project's own cluster (shared by the run's processes), a pool per process ----
@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[Any]:
    """``own_cluster(name, **settings)``: a PostgreSQL cluster of the test's own under
    ``tmp_path``, removed after the test (:meth:`~birdenv.postgres.PrivateCluster.remove`): a
    home the server's user cannot reach is moved to the system's temporary directory, where it
    would outlive ``tmp_path``, its server still running."""
    from birdenv.postgres import PrivateCluster, find_bindir

    made: list[Any] = []

    def make(name: str, **settings: Any) -> Any:
        made.append(PrivateCluster(tmp_path / name, bindir=find_bindir(), **settings))
        return made[-1]

    yield make
    for cluster in made:
        cluster.remove()


@pytest.fixture(scope="session")
def pg_pool() -> Iterator[Any]:
    """A database pool on the default server (the private cluster, started on first use)."""
    from birdenv.postgres import DatabasePool

    with DatabasePool(ready=2) as pool:
        yield pool


@pytest.fixture(scope="session")
def pg_shop(pg_pool: Any) -> str:
    """The template of the shop database (:data:`SHOP_SQL`) on PostgreSQL; its name."""
    from birdenv.postgres import Template

    digest = hashlib.sha256(SHOP_SQL.encode()).hexdigest()
    return pg_pool.template(Template("shop", digest, lambda db: db.execute(SHOP_SQL)))


@pytest.fixture()
def official_shop(pg_pool: Any) -> Iterator[str]:
    """A ``db_id`` whose ``{db_id}_template`` database is on the server, made as the official
    PostgreSQL images make theirs: the shop tables (:data:`SHOP_SQL`) owned by the administrator,
    in a template that takes no connections. Its name is the test's own: the tests of another
    worker, and another run on the same server, make theirs beside it (a fixed name met one that
    a run stopped midway had left marked a template, which ``DROP DATABASE`` refuses)."""
    from birdenv.postgres.server import psycopg

    db_id = f"shop_{secrets.token_hex(4)}"
    template = f"{db_id}_template"
    with pg_pool.server.admin() as admin:
        admin.execute(f"CREATE DATABASE {template}")
    try:
        with psycopg().connect(**pg_pool.server.connect_kwargs(template), autocommit=True) as db:
            db.execute(SHOP_SQL)
        with pg_pool.server.admin() as admin:
            admin.execute(
                f"ALTER DATABASE {template} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false"
            )
        yield db_id
    finally:
        with pg_pool.server.admin() as admin:
            admin.execute(f"ALTER DATABASE {template} WITH IS_TEMPLATE false")
            admin.execute(f"DROP DATABASE {template}")


# -- a strict OpenAI-compatible chat endpoint on loopback ------------------------------------------
_MESSAGE_KEYS = {
    "system": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "tool_calls", "name"},
    "tool": {"role", "content", "tool_call_id"},
}


def openai_violation(body: dict) -> str | None:
    """What in a ``/v1/chat/completions`` request breaks OpenAI's chat and tool-calling form, or
    None. Strict as OpenAI's API and vLLM with a tool parser are: every tool call has an id and
    JSON arguments, every ``tool`` message answers a call of the assistant message before it by
    ``tool_call_id``, and an earlier tool call may not travel as assistant text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list"
    unanswered: set[str] = set()
    for k, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _MESSAGE_KEYS:
            return f"messages[{k}]: unknown role {role!r}"
        if set(message) - _MESSAGE_KEYS[role]:
            return f"messages[{k}]: unexpected keys {sorted(set(message) - _MESSAGE_KEYS[role])}"
        content = message.get("content")
        if role == "tool":
            if message.get("tool_call_id") not in unanswered:
                return f"messages[{k}]: a tool message must answer a tool call by its tool_call_id"
            unanswered.discard(message["tool_call_id"])
        elif unanswered:
            return f"messages[{k}]: tool calls {sorted(unanswered)} were not answered"
        if role == "assistant":
            calls = message.get("tool_calls")
            if content is None and not calls:
                return f"messages[{k}]: an assistant message needs content or tool_calls"
            if isinstance(content, str):
                with contextlib.suppress(ToolCallError):
                    parse_tool_call(content)
                    return f"messages[{k}]: a tool call sent as assistant text, not in tool_calls"
            for call in calls or []:
                function = call.get("function") or {}
                if not isinstance(call.get("id"), str) or call.get("type") != "function":
                    return f"messages[{k}]: a tool call needs an id and type 'function'"
                if not isinstance(function.get("name"), str):
                    return f"messages[{k}]: a tool call needs a function name"
                try:
                    if not isinstance(json.loads(function.get("arguments")), dict):
                        raise ValueError
                except (TypeError, ValueError):
                    return f"messages[{k}]: tool call arguments must be a JSON object string"
                unanswered.add(call["id"])
        if content is not None and not isinstance(content, str):
            return f"messages[{k}]: content must be a string"
        if role != "assistant" and content is None:
            return f"messages[{k}]: a {role} message needs content"
    return None


class ChatServer:
    """A strict OpenAI-compatible chat endpoint on loopback running a model with ``generate``.

    A request that breaks OpenAI's form gets HTTP 400 with the reason (:func:`openai_violation`).
    Replies that hold one tool call come back in ``tool_calls``, the way a server with a tool
    parser answers. ``scripted`` replies are given first, in order, instead of the model's.
    """

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.requests: list[dict] = []
        self.replies: list[str] = []
        self.scripted: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.startswith("/broken/"):
                    return self._send(200, b"<html>not an API</html>")
                if self.path != "/v1/chat/completions":
                    return self._send(
                        404, b'{"error": {"message": "no route ' + self.path.encode() + b'"}}'
                    )
                violation = openai_violation(body)
                if violation is not None:
                    return self._send(400, json.dumps({"error": {"message": violation}}).encode())
                server.requests.append(body)
                if server.scripted:
                    return self._reply(body, server.scripted.pop(0))
                import torch

                ids = tokenizer.apply_chat_template(
                    body["messages"],
                    tools=body.get("tools"),
                    add_generation_prompt=True,
                    return_tensors="pt",
                    return_dict=True,
                )
                torch.manual_seed(len(server.requests))
                out = model.generate(
                    **ids,
                    max_new_tokens=body.get("max_tokens", 12),
                    min_new_tokens=4,
                    do_sample=True,
                    pad_token_id=tokenizer.pad_token_id,
                )
                text = tokenizer.decode(
                    out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True
                )
                self._reply(body, text.strip() or "x")

            def _reply(self, body: dict, text: str) -> None:
                server.replies.append(text)
                message: dict[str, Any] = {"role": "assistant", "content": text}
                try:
                    call = parse_tool_call(text)
                except ToolCallError:
                    call = None
                if call is not None:
                    before = text[: text.index("<tool_call>")].removesuffix("\n")
                    arguments = json.dumps(call.arguments)
                    message = {
                        "role": "assistant",
                        "content": before or None,
                        "tool_calls": [
                            {
                                "id": f"call_{len(server.replies)}",
                                "type": "function",
                                "function": {"name": call.name, "arguments": arguments},
                            }
                        ],
                    }
                reply = {
                    "object": "chat.completion",
                    "model": body["model"],
                    "choices": [{"index": 0, "message": message}],
                }
                self._send(200, json.dumps(reply).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop serving."""
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="session")
def chat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChatServer]:
    """A strict OpenAI-compatible endpoint serving the tiny random model (train extra)."""
    pytest.importorskip("transformers", reason="the endpoint's model needs the train extra")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from birdtrain.models import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("endpoint-model"))
    server = ChatServer(
        AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    )
    yield server
    server.close()

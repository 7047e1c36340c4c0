"""Shared fixtures: small real SQLite databases in the official layout, and replica pools."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

# Ray tests run inside a private network namespace: hooks and the cluster fixture live there.
from private_network import (  # noqa: F401
    pytest_runtest_makereport,
    pytest_runtest_protocol,
    ray_cluster,
)

from birdenv.replicas import ReplicaPool, overlay
from birdenv.tasks import load_tasks

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

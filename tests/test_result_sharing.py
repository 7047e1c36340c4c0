"""Result sharing is exact: shared against unshared execution over random trajectories.

Trajectories branch from one another (a trajectory copies a prefix of an earlier one, then goes its
own way), on two tasks of one base (one with a preprocess), with small caps so results are cut.
Each runs on a pool that shares results and, statement by statement, on a twin session of a pool
that does not. Every result must be the twin's (columns, rows, counts, caps, errors); the only
difference allowed is where it came from.

Statements whose value is not a function of the state (``random()``, ``'now'``, ``changes()``...)
cannot be compared between twins. The test labels them itself, independently of the
implementation, and checks the other half of exactness instead: such a read is never served from
the cache, and after such a change (including ``DEFAULT (random())``, ``CURRENT_TIMESTAMP``
defaults and triggers, which SQLite hides from the authorizer) nothing of that trajectory is.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from contextlib import closing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from birdenv.replicas import Limits, ReplicaPool
from birdenv.replicas.results import ResultCache
from birdenv.replicas.session import Result
from birdenv.tasks import parse_task

BASE_SQL = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT);
CREATE TABLE orders (
    id INTEGER PRIMARY KEY,
    customer_id INTEGER REFERENCES customers(id) ON DELETE CASCADE,
    total REAL
);
CREATE INDEX orders_customer ON orders(customer_id);
CREATE VIEW big_orders AS SELECT * FROM orders WHERE total > 100;
CREATE VIEW dice AS SELECT abs(random()) % 6 AS roll FROM customers;
CREATE TABLE tokens (id INTEGER PRIMARY KEY, token DEFAULT (hex(randomblob(8))));
CREATE TABLE stamps (id INTEGER PRIMARY KEY, at TEXT DEFAULT CURRENT_TIMESTAMP);
CREATE TABLE events (id INTEGER PRIMARY KEY, kind TEXT);
CREATE TRIGGER events_token AFTER INSERT ON events BEGIN INSERT INTO tokens(id) VALUES (NULL); END;
CREATE TRIGGER events_roll AFTER UPDATE OF kind ON events
BEGIN UPDATE events SET kind = kind || abs(random() % 6) WHERE id = new.id; END;
INSERT INTO events VALUES (1, 'seed');
CREATE TABLE edge (id INTEGER PRIMARY KEY, v TEXT);
INSERT INTO edge VALUES (9223372036854775807, 'top');
INSERT INTO customers VALUES (1, 'Ann', 'Paris'), (2, 'bob', NULL), (3, 'Cid', 'Rome'),
    (4, 'ann', 'Oslo');
INSERT INTO orders VALUES (1, 1, 120.5), (2, 1, 80.0), (3, 2, NULL), (4, 3, 300.25), (5, 4, 12);
"""

# (statement, label): "read" and "change" are functions of the state; "vread" and "vchange" are not.
STATEMENTS = [
    # reads, some cut by the caps, some errors
    ("SELECT id, name, city FROM customers ORDER BY id", "read"),
    ("SELECT id FROM customers", "read"),  # unordered: reverse_unordered_selects shows
    ("SELECT name FROM customers WHERE name LIKE 'a%'", "read"),  # case_sensitive_like shows
    ("SELECT count(*), sum(total) FROM orders", "read"),
    ("SELECT * FROM big_orders", "read"),
    ("SELECT type, name FROM sqlite_master ORDER BY name", "read"),
    ("SELECT type, name FROM sqlite_temp_master ORDER BY name", "read"),
    ("SELECT * FROM notes ORDER BY n", "read"),
    ("SELECT x FROM scratch", "read"),
    ("SELECT * FROM nowhere", "read"),
    ("SELECT * FROM m.kept", "read"),
    ("SELECT count(*) FROM tokens", "read"),
    ("SELECT token FROM tokens ORDER BY id", "read"),
    ("SELECT at FROM stamps", "read"),
    ("SELECT v FROM edge ORDER BY id", "read"),
    (
        "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 30) SELECT i FROM r",
        "read",
    ),
    ("SELECT printf('%.400c', 'x') FROM orders", "read"),
    ("SELECT abs(-9223372036854775808)", "read"),
    ("EXPLAIN QUERY PLAN SELECT * FROM orders WHERE customer_id = 1", "read"),
    ("VALUES (1), (2)", "read"),
    ("SELECT json_extract('{\"a\": [1, 2]}', '$.a[1]'), upper(name) FROM customers", "read"),
    # reads whose value is not a function of the state
    ("SELECT random()", "vread"),
    ("SELECT roll FROM dice", "vread"),
    ("SELECT datetime('now')", "vread"),
    ("SELECT changes(), total_changes()", "vread"),
    ("SELECT last_insert_rowid()", "vread"),
    # changes, all deterministic
    ("INSERT INTO customers (name, city) VALUES ('Dee', 'Lyon')", "change"),
    ("UPDATE orders SET total = coalesce(total, 0) + 1 WHERE customer_id = 1", "change"),
    ("DELETE FROM orders WHERE id = 2", "change"),
    ("DELETE FROM customers WHERE id = 3", "change"),
    ("UPDATE customers SET id = 1 WHERE id = 2", "change"),  # a constraint error
    ("INSERT INTO nowhere VALUES (1)", "change"),
    ("CREATE TABLE IF NOT EXISTS notes (n INTEGER)", "change"),
    ("INSERT INTO notes SELECT count(*) FROM orders", "change"),
    ("CREATE TEMP TABLE IF NOT EXISTS scratch AS SELECT 42 AS x", "change"),
    ("DROP TABLE IF EXISTS temp.scratch", "change"),
    ("CREATE INDEX IF NOT EXISTS customers_city ON customers(city)", "change"),
    ("DROP INDEX IF EXISTS customers_city", "change"),
    ("PRAGMA foreign_keys = ON", "change"),
    ("PRAGMA case_sensitive_like = ON", "change"),
    ("PRAGMA reverse_unordered_selects = ON", "change"),
    ("PRAGMA reverse_unordered_selects = OFF", "change"),
    ("PRAGMA table_info(customers)", "change"),
    ("SELECT name FROM pragma_table_info('orders')", "change"),
    ("BEGIN", "change"),
    ("COMMIT", "change"),
    ("ROLLBACK", "change"),
    ("SAVEPOINT s", "change"),
    ("ROLLBACK TO s", "change"),
    ("RELEASE s", "change"),
    ("ATTACH ':memory:' AS m", "change"),
    ("CREATE TABLE IF NOT EXISTS m.kept AS SELECT name FROM customers", "change"),
    ("ANALYZE", "change"),
    ("VACUUM", "change"),
    ("REINDEX", "change"),
    # changes whose effect is not a function of the state
    ("INSERT INTO tokens (id) VALUES (NULL)", "vchange"),  # DEFAULT (hex(randomblob(8)))
    ("INSERT INTO stamps DEFAULT VALUES", "vchange"),  # DEFAULT CURRENT_TIMESTAMP
    ("INSERT INTO events (kind) VALUES ('x')", "vchange"),  # its trigger writes tokens
    ("UPDATE events SET kind = 'rolled'", "vchange"),  # its trigger calls random()
    ("INSERT INTO edge (v) VALUES ('next')", "vchange"),  # the largest rowid is taken: random
    ("UPDATE orders SET total = random() % 100 WHERE id = 1", "vchange"),
    ("CREATE TABLE IF NOT EXISTS rolls AS SELECT random() AS r", "vchange"),
]
SAMPLED = st.sampled_from(STATEMENTS)
LIMITS = Limits(statement_timeout=20, max_rows=7, max_result_bytes=2_000)
#: Limits a trajectory may lease its session with (pools default to the first).
SESSION_LIMITS = [LIMITS, Limits(statement_timeout=20, max_rows=3, max_result_bytes=600)]
Q = "SELECT id FROM customers"
L = "SELECT name FROM customers WHERE name LIKE 'a%'"
WIDE = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 30) SELECT i FROM r"


def observable(result: Result) -> tuple:
    """Everything a result says, except how long it took and where it came from."""
    return (
        result.columns,
        result.rows,
        result.rowcount,
        result.truncated,
        result.error,
        result.timed_out,
    )


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> tuple[Path, list]:
    """A base with volatile defaults, a volatile view and trigger, and two tasks on it."""
    root = tmp_path_factory.mktemp("lab")
    path = root / "dbs" / "lab" / "lab_template.sqlite"
    path.parent.mkdir(parents=True)
    with closing(sqlite3.connect(path)) as conn:
        conn.executescript(BASE_SQL)
    tasks = [
        parse_task({"instance_id": "plain", "db_id": "lab"}, db_dir=root / "dbs"),
        parse_task(
            {
                "instance_id": "trimmed",
                "db_id": "lab",
                "preprocess_sql": ["DELETE FROM orders WHERE total < 50"],
            },
            db_dir=root / "dbs",
        ),
    ]
    return root, tasks


Plan = list[tuple[int, bool, int, list[tuple[str, str]]]]


@st.composite
def trajectories(draw: st.DrawFn) -> Plan:
    """Trajectories as (task, exclusive, limits, statements) over a small vocabulary, so that they
    often meet in one state: each after the first may start as a copy of a prefix of an earlier
    one, the way G rollouts of one task do."""
    vocabulary = st.sampled_from(draw(st.lists(SAMPLED, min_size=2, max_size=10, unique=True)))
    out: Plan = []
    for i in range(draw(st.integers(2, 8))):
        task, exclusive, limits = draw(st.integers(0, 1)), draw(st.booleans()), 0
        statements: list[tuple[str, str]] = []
        if draw(st.integers(0, 4)) == 0:
            limits = 1
        if i and draw(st.integers(0, 2)):
            task, exclusive, limits, parent = out[draw(st.integers(0, i - 1))]
            statements = list(parent[: draw(st.integers(0, len(parent)))])
        statements += draw(st.lists(vocabulary, max_size=8))
        out.append((task, exclusive, limits, statements))
    return out


class Counts:
    hits = 0
    compared = 0


def play(pools: tuple[ReplicaPool, ReplicaPool], tasks: list, plan: Plan, order: list[int]) -> int:
    """Run every trajectory on both pools, turn by turn in ``order``, comparing as it goes;
    returns how many results were shared."""
    shared, alone = pools
    pairs = [
        (
            shared.session(tasks[t], exclusive=x, limits=SESSION_LIMITS[k]),
            alone.session(tasks[t], exclusive=x, limits=SESSION_LIMITS[k]),
        )
        for t, x, k, _ in plan
    ]
    turn = [0] * len(plan)
    diverged = [False] * len(plan)
    hits = 0
    try:
        for i in order:
            statements = plan[i][3]
            if turn[i] >= len(statements):
                continue
            sql, label = statements[turn[i]]
            turn[i] += 1
            got, expected = pairs[i][0].execute(sql), pairs[i][1].execute(sql)
            hits += got.shared
            if label in ("vread", "vchange") or diverged[i]:
                assert not got.shared, (sql, "a result that is not a function of the state")
            else:
                Counts.compared += 1
                assert observable(got) == observable(expected), (i, sql, got, expected)
            diverged[i] = diverged[i] or label == "vchange"
    finally:
        for pair in pairs:
            for session in pair:
                session.close()
    Counts.hits += hits
    return hits


@given(plan=trajectories(), data=st.data())
@settings(
    max_examples=int(os.environ.get("RESULTS_EXAMPLES", "150")),
    # The same examples every run: how many of them share (checked below) must not be chance.
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_shared_results_equal_unshared_execution(lab, plan, data) -> None:
    root, tasks = lab
    steps = [i for i, (_, _, _, statements) in enumerate(plan) for _ in statements]
    # a random interleaving, or one trajectory after the other
    order = data.draw(st.permutations(steps)) if data.draw(st.booleans()) else steps
    with (
        ReplicaPool(root=root / "replicas", limits=LIMITS) as shared,
        ReplicaPool(root=root / "replicas", limits=LIMITS, share_results=False) as alone,
    ):
        play((shared, alone), tasks, plan, order)


def _read(sql: str) -> tuple[str, str]:
    return (sql, "read")


def _change(sql: str) -> tuple[str, str]:
    return (sql, "change")


# One scenario per rule: trajectories run one after the other; the later ones must get what their
# unshared twins get, and the scenario must share at least ``min_hits`` results.
SCENARIOS = {
    "a pragma is a change": (
        [
            (0, False, 0, [_read(Q), _read(L)]),
            (
                0,
                False,
                0,
                [
                    _change("PRAGMA reverse_unordered_selects = ON"),
                    _read(Q),
                    _change("PRAGMA case_sensitive_like = ON"),
                    _read(L),
                ],
            ),
        ],
        0,
    ),
    "a pragma is never served from the cache": (
        [(0, False, 0, [_change("PRAGMA reverse_unordered_selects = ON"), _read(Q)])] * 2
        + [(0, False, 0, [_read(Q)])],
        1,
    ),
    "TEMP objects are changes": (
        [
            (
                0,
                False,
                0,
                [
                    _change("CREATE TEMP TABLE IF NOT EXISTS scratch AS SELECT 42 AS x"),
                    _read("SELECT x FROM scratch"),
                ],
            ),
            (0, False, 0, [_read("SELECT x FROM scratch")]),
        ],
        0,
    ),
    "an attached database is a change": (
        [
            (
                0,
                False,
                0,
                [
                    _change("ATTACH ':memory:' AS m"),
                    _change("CREATE TABLE m.kept AS SELECT 1 AS one"),
                    _read("SELECT * FROM m.kept"),
                ],
            ),
            (0, False, 0, [_read("SELECT * FROM m.kept")]),
        ],
        0,
    ),
    "a read that commits an open transaction": (
        [
            (
                0,
                False,
                0,
                [
                    _change("BEGIN"),
                    _change("DELETE FROM orders"),
                    _read("VALUES (1), (2)"),
                    _change("ROLLBACK"),
                    _read("SELECT count(*) FROM orders"),
                ],
            )
        ]
        * 2,
        0,
    ),
    "an error that rolls back an open transaction": (
        [
            (
                0,
                False,
                0,
                [
                    _change("BEGIN"),
                    _change("DELETE FROM orders"),
                    _read("SELECT * FROM nowhere"),
                    _read("SELECT count(*) FROM orders"),
                ],
            )
        ]
        * 2,
        0,
    ),
    "the same history shares, errors and caps included": (
        [
            (
                0,
                True,
                0,
                [
                    _change("DELETE FROM orders WHERE id = 1"),
                    _read("SELECT * FROM nowhere"),
                    _read(WIDE),
                    _read("SELECT abs(-9223372036854775808)"),
                ],
            )
        ]
        * 2,
        3,
    ),
    "a preprocess is part of the state": (
        [
            (0, False, 0, [_read("SELECT count(*) FROM orders")]),
            (1, False, 0, [_read("SELECT count(*) FROM orders")]),
        ],
        0,
    ),
    "the caps are part of the state": (
        [(0, False, 0, [_read(WIDE)]), (0, False, 1, [_read(WIDE)])],
        0,
    ),
    "a view redefined to be volatile": (
        [
            (
                0,
                False,
                0,
                [
                    _read("SELECT * FROM big_orders"),
                    _change("DROP VIEW big_orders"),
                    _change("CREATE VIEW big_orders AS SELECT random() AS r"),
                    ("SELECT * FROM big_orders", "vread"),
                ],
            )
        ]
        * 2,
        1,
    ),
}
# sqlite_stmt lists the connection's own prepared statements; only its first use in a
# connection looks like a change to the authorizer
SCENARIOS["a table that shows the connection itself"] = (
    [
        (
            0,
            False,
            0,
            [
                ("SELECT count(*) FROM sqlite_stmt", "vread"),
                ("SELECT sql FROM sqlite_stmt", "vread"),
            ],
        )
    ]
    * 2,
    0,
)
for _name, _sql in (
    ("a column default of random()", "INSERT INTO tokens (id) VALUES (NULL)"),
    ("a CURRENT_TIMESTAMP default", "INSERT INTO stamps DEFAULT VALUES"),
    ("a trigger that writes a volatile default", "INSERT INTO events (kind) VALUES ('x')"),
    ("a trigger that calls random()", "UPDATE events SET kind = 'rolled'"),
    ("an insert at the largest rowid", "INSERT INTO edge (v) VALUES ('next')"),
):
    SCENARIOS[_name] = (
        [
            (
                0,
                False,
                0,
                [
                    (_sql, "vchange"),
                    _read("SELECT * FROM tokens"),
                    _read("SELECT * FROM stamps"),
                    _read("SELECT * FROM edge"),
                    _read("SELECT * FROM events"),
                ],
            )
        ]
        * 2,
        0,
    )


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_sharing_rules(lab, name) -> None:
    root, tasks = lab
    plan, min_hits = SCENARIOS[name]
    order = [i for i, (_, _, _, statements) in enumerate(plan) for _ in statements]
    with (
        ReplicaPool(root=root / "replicas", limits=LIMITS) as shared,
        ReplicaPool(root=root / "replicas", limits=LIMITS, share_results=False) as alone,
    ):
        assert play((shared, alone), tasks, plan, order) >= min_hits


def test_the_property_test_compares_and_shares() -> None:
    """The examples above (run first, in file order) really compared results and hit the cache."""
    print(f"\nresult sharing: {Counts.compared} results compared, {Counts.hits} shared")
    assert Counts.compared > 500 and Counts.hits > 200, (Counts.compared, Counts.hits)


def test_siblings_share_and_threads_agree(lab) -> None:
    """G = 8 rollouts of a task, in eight threads at once: the same reads run once per state, and
    every result is the one an unshared session gets."""
    root, tasks = lab
    script = [sql for sql, label in STATEMENTS if label in ("read", "change")]
    with (
        ReplicaPool(root=root / "replicas", limits=LIMITS) as shared,
        ReplicaPool(root=root / "replicas", limits=LIMITS, share_results=False) as alone,
    ):
        with alone.session(tasks[1]) as session:
            expected = [observable(session.execute(sql)) for sql in script]
        barrier = threading.Barrier(8)
        got: dict[int, list] = {}

        def rollout(k: int) -> None:
            with shared.session(tasks[1]) as session:
                barrier.wait()
                got[k] = [observable(session.execute(sql)) for sql in script]

        threads = [threading.Thread(target=rollout, args=(k,)) for k in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = shared.stats()
    assert all(got[k] == expected for k in range(8))
    reads = sum(1 for sql, label in STATEMENTS if label == "read")
    # the first thread to reach a state runs each read once; the other seven wait for its result
    assert stats["results_hits"] == 7 * reads, stats


def test_a_waiter_runs_the_statement_itself_when_the_first_run_shares_nothing() -> None:
    """A thread waiting on a sibling's run of the same key gets the result the sibling stored, or,
    when the sibling stored none (a change, a volatile read), None at once: it runs it itself."""
    cache = ResultCache()
    assert cache.get("k") is None  # this thread runs "k" now
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(cache.get("k", timeout=30)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waiting for this thread's run
    cache.release("k")  # nothing stored: a change
    waiter.join(5)
    assert not waiter.is_alive() and got == [None]
    stored = Result(["x"], [(1,)], 1, False, None, 0.5)
    assert cache.get("k2") is None
    waiter = threading.Thread(target=lambda: got.append(cache.get("k2", timeout=30)))
    waiter.start()
    waiter.join(0.2)
    cache.put("k2", stored, 64)
    cache.release("k2")
    waiter.join(5)
    assert got == [None, stored]
    assert cache.stats()["hits"] == 1
    # the thread running "k3" asking again (for another session) does not wait on itself
    assert cache.get("k3") is None
    assert cache.get("k3", timeout=30) is None
    # a waiter gives up after its timeout (the statement's own limit) and runs it itself
    box: list[object] = []
    waiter = threading.Thread(target=lambda: box.append(cache.get("k3", timeout=0.05)))
    waiter.start()
    waiter.join(5)
    assert box == [None]


def test_a_session_used_directly_stops_sharing(lab) -> None:
    """Statements run on ``conn`` are not in the history, so the session leaves the cache alone."""
    root, tasks = lab
    with ReplicaPool(root=root / "replicas") as pool:
        with pool.session(tasks[0]) as a:
            assert a.execute("SELECT count(*) FROM customers").rows == [(4,)]
        with pool.session(tasks[0]) as b:
            b.conn.execute("DELETE FROM customers")
            b.conn.commit()
            result = b.execute("SELECT count(*) FROM customers")
            assert result.rows == [(0,)] and not result.shared
        with pool.session(tasks[0]) as c:
            other = c.connect()
            other.execute("DELETE FROM customers WHERE id = 1")
            other.commit()
            other.close()
            result = c.execute("SELECT count(*) FROM customers")
            assert result.rows == [(3,)] and not result.shared
        with pool.session(tasks[0]) as d:
            result = d.execute("SELECT count(*) FROM customers")
            assert result.rows == [(4,)] and result.shared


def test_the_cache_is_bounded(lab) -> None:
    root, tasks = lab
    with ReplicaPool(root=root / "replicas", results_max_bytes=64 << 10) as pool:
        with pool.session(tasks[0]) as session:
            for i in range(400):
                assert session.execute(f"SELECT {i}, printf('%.300c', 'x')").ok
        stats = pool.stats()
    assert stats["results_bytes"] <= 64 << 10
    assert stats["results_evicted"] > 0 and stats["results_entries"] < 400

"""bank_finance: a retail bank in the style of BIRD's ``financial`` database.

Tables: ``districts``, ``clients`` (a spaced column ``"Phone Number"``), ``accounts`` (a balance
kept by a trigger), ``dispositions`` (who may use which account), ``cards`` (MixedCase column
``"creditLimit"``), ``loans`` (status codes A-D, NULL for pending applications), ``transactions``
(REAL amounts, TEXT dates, running ``balance_after``) and ``balance_audit``. Triggers: every new
transaction moves its account's balance; every balance change is written to ``balance_audit``.
View: ``account_overview``.

Everything comes from ``random.Random(SEED)``: the same bytes on every build.
"""

from __future__ import annotations

import datetime
import random
import sqlite3

DB_ID = "bank_finance"
VERSION = 1
SEED = 7_310_422

N_DISTRICTS = 60
N_CLIENTS = 5200
N_ACCOUNTS = 4400
END = datetime.date(2023, 12, 31)

SCHEMA = [
    """CREATE TABLE districts (
        district_id INTEGER PRIMARY KEY,
        district_name TEXT NOT NULL,
        region TEXT NOT NULL,
        inhabitants INTEGER,
        avg_salary INTEGER,
        unemployment_rate REAL
    )""",
    """CREATE TABLE clients (
        client_id INTEGER PRIMARY KEY,
        first_name TEXT NOT NULL,
        last_name TEXT NOT NULL,
        gender TEXT NOT NULL CHECK (gender IN ('F', 'M')),
        birth_date TEXT NOT NULL,
        district_id INTEGER NOT NULL REFERENCES districts(district_id),
        email TEXT,
        "Phone Number" TEXT
    )""",
    """CREATE TABLE accounts (
        account_id INTEGER PRIMARY KEY,
        district_id INTEGER NOT NULL REFERENCES districts(district_id),
        frequency TEXT NOT NULL,
        opened_on TEXT NOT NULL,
        status TEXT NOT NULL DEFAULT 'active',
        closed_on TEXT,
        balance REAL NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE dispositions (
        disp_id INTEGER PRIMARY KEY,
        client_id INTEGER NOT NULL REFERENCES clients(client_id) ON DELETE CASCADE,
        account_id INTEGER NOT NULL REFERENCES accounts(account_id) ON DELETE CASCADE,
        type TEXT NOT NULL CHECK (type IN ('OWNER', 'DISPONENT'))
    )""",
    """CREATE TABLE cards (
        card_id INTEGER PRIMARY KEY,
        disp_id INTEGER NOT NULL REFERENCES dispositions(disp_id) ON DELETE CASCADE,
        type TEXT NOT NULL,
        issued_on TEXT NOT NULL,
        "creditLimit" REAL
    )""",
    """CREATE TABLE loans (
        loan_id INTEGER PRIMARY KEY,
        account_id INTEGER NOT NULL REFERENCES accounts(account_id) ON DELETE CASCADE,
        granted_on TEXT NOT NULL,
        amount REAL NOT NULL,
        duration INTEGER NOT NULL,
        payments REAL NOT NULL,
        status TEXT,
        closed_on TEXT
    )""",
    """CREATE TABLE transactions (
        trans_id INTEGER PRIMARY KEY,
        account_id INTEGER NOT NULL REFERENCES accounts(account_id) ON DELETE CASCADE,
        trans_date TEXT NOT NULL,
        type TEXT NOT NULL CHECK (type IN ('credit', 'debit')),
        operation TEXT,
        amount REAL NOT NULL,
        balance_after REAL,
        k_symbol TEXT,
        bank_to TEXT,
        account_to INTEGER
    )""",
    """CREATE TABLE balance_audit (
        audit_id INTEGER PRIMARY KEY AUTOINCREMENT,
        account_id INTEGER NOT NULL REFERENCES accounts(account_id) ON DELETE CASCADE,
        old_balance REAL,
        new_balance REAL,
        changed_at TEXT NOT NULL
    )""",
]

POST_SCHEMA = [
    "CREATE INDEX idx_clients_district ON clients(district_id)",
    "CREATE INDEX idx_accounts_district ON accounts(district_id)",
    "CREATE INDEX idx_disp_client ON dispositions(client_id)",
    "CREATE INDEX idx_disp_account ON dispositions(account_id)",
    "CREATE INDEX idx_cards_disp ON cards(disp_id)",
    "CREATE INDEX idx_loans_account ON loans(account_id)",
    "CREATE INDEX idx_trans_account_date ON transactions(account_id, trans_date)",
    "CREATE INDEX idx_trans_date ON transactions(trans_date)",
    "CREATE INDEX idx_audit_account ON balance_audit(account_id)",
    """CREATE VIEW account_overview AS
        SELECT a.account_id, c.client_id, c.first_name || ' ' || c.last_name AS owner_name,
               d.district_name, d.region, a.frequency, a.status, a.balance
        FROM accounts a
        JOIN dispositions dp ON dp.account_id = a.account_id AND dp.type = 'OWNER'
        JOIN clients c ON c.client_id = dp.client_id
        JOIN districts d ON d.district_id = a.district_id""",
    """CREATE TRIGGER trg_transactions_balance AFTER INSERT ON transactions
        BEGIN
            UPDATE accounts
            SET balance = balance + CASE WHEN NEW.type = 'credit' THEN NEW.amount ELSE -NEW.amount END
            WHERE account_id = NEW.account_id;
        END""",
    """CREATE TRIGGER trg_accounts_audit AFTER UPDATE OF balance ON accounts
        WHEN OLD.balance IS NOT NEW.balance
        BEGIN
            INSERT INTO balance_audit (account_id, old_balance, new_balance, changed_at)
            VALUES (NEW.account_id, OLD.balance, NEW.balance, datetime('now'));
        END""",
]

_REGIONS = ["North", "South", "East", "West", "Central", "Capital"]
_TOWNS = [
    "Ashford",
    "Brookvale",
    "Carlow",
    "Dunmore",
    "Elmstead",
    "Fairhaven",
    "Glenrock",
    "Hartwell",
    "Ironbridge",
    "Juniper",
    "Kingsbury",
    "Lakeside",
    "Millbrook",
    "Northam",
    "Oakridge",
    "Pinecrest",
    "Queensford",
    "Riverton",
    "Stonegate",
    "Thornbury",
]
_FIRST_F = [
    "Alena",
    "Barbora",
    "Dana",
    "Eva",
    "Hana",
    "Ivana",
    "Jana",
    "Klara",
    "Lenka",
    "Marie",
    "Petra",
    "Sofie",
    "Tereza",
    "Vera",
    "Zuzana",
]
_FIRST_M = [
    "Adam",
    "Daniel",
    "Filip",
    "Jakub",
    "Jan",
    "Josef",
    "Karel",
    "Lukas",
    "Martin",
    "Michal",
    "Ondrej",
    "Pavel",
    "Petr",
    "Tomas",
    "Vojtech",
]
_LAST = [
    "Novak",
    "Svoboda",
    "Novotny",
    "Dvorak",
    "Cerny",
    "Prochazka",
    "Kucera",
    "Vesely",
    "Horak",
    "Nemec",
    "Marek",
    "Pokorny",
    "Pospisil",
    "Hajek",
    "Jelinek",
    "Kral",
    "Ruzicka",
    "Benes",
    "Fiala",
    "Sedlacek",
]
_BANKS = ["AB", "CD", "EF", "GH", "IJ", "KL", "MN", "OP", "QR", "ST", "UV", "WX", "YZ"]


def _day(rng: random.Random, lo: datetime.date, hi: datetime.date) -> datetime.date:
    return datetime.date.fromordinal(rng.randint(lo.toordinal(), hi.toordinal()))


def _add_months(d: datetime.date, months: int) -> datetime.date:
    y, m = divmod(d.month - 1 + months, 12)
    return datetime.date(d.year + y, m + 1, min(d.day, 28))


def _districts(rng: random.Random):
    names = []
    for town in _TOWNS:
        for suffix in ("", " North", " South"):
            names.append(town + suffix)
    for i in range(1, N_DISTRICTS + 1):
        unemployment = None if rng.random() < 0.05 else round(rng.uniform(0.4, 9.8), 2)
        yield (
            i,
            names[i - 1],
            rng.choice(_REGIONS),
            rng.randint(4_000, 1_200_000),
            rng.randint(7_800, 13_000),
            unemployment,
        )


def _clients(rng: random.Random):
    for i in range(1, N_CLIENTS + 1):
        gender = rng.choice("FM")
        first = rng.choice(_FIRST_F if gender == "F" else _FIRST_M)
        last = rng.choice(_LAST) + ("ova" if gender == "F" and rng.random() < 0.8 else "")
        birth = _day(rng, datetime.date(1935, 1, 1), datetime.date(2010, 12, 31))
        email = (
            None
            if rng.random() < 0.3
            else f"{first.lower()}.{last.lower()}{i}@{rng.choice(['post.cz', 'mail.com', 'Bank-Mail.com'])}"
        )
        phone = (
            None
            if rng.random() < 0.25
            else f"+420 {rng.randint(600, 799)} {rng.randint(100, 999)} {rng.randint(100, 999)}"
        )
        yield i, first, last, gender, birth.isoformat(), rng.randint(1, N_DISTRICTS), email, phone


def build(conn: sqlite3.Connection) -> None:
    """Fill an empty database (inside the caller's transaction)."""
    rng = random.Random(SEED)
    for stmt in SCHEMA:
        conn.execute(stmt)
    conn.executemany("INSERT INTO districts VALUES (?,?,?,?,?,?)", _districts(rng))
    clients = list(_clients(rng))
    conn.executemany("INSERT INTO clients VALUES (?,?,?,?,?,?,?,?)", clients)

    accounts, disps, cards, loans, trans = [], [], [], [], []
    # Each client owns at most one account; accounts 1..N_ACCOUNTS go to shuffled clients.
    owners = list(range(1, N_CLIENTS + 1))
    rng.shuffle(owners)
    disp_id = card_id = loan_id = trans_id = 0
    for acc in range(1, N_ACCOUNTS + 1):
        owner = owners[acc - 1]
        opened = _day(rng, datetime.date(2015, 1, 1), datetime.date(2022, 12, 31))
        frequency = rng.choices(["monthly", "weekly", "after_transaction"], [8, 1, 1])[0]
        disp_id += 1
        disps.append((disp_id, owner, acc, "OWNER"))
        owner_disp = disp_id
        if rng.random() < 0.18:
            disp_id += 1
            disps.append(
                (
                    disp_id,
                    owners[N_ACCOUNTS + rng.randrange(N_CLIENTS - N_ACCOUNTS)],
                    acc,
                    "DISPONENT",
                )
            )
        if rng.random() < 0.22:
            card_id += 1
            ctype = rng.choices(["classic", "junior", "gold"], [6, 2, 1])[0]
            limit = (
                None if ctype == "junior" else float(rng.choice([1000, 2000, 5000, 10000, 20000]))
            )
            cards.append((card_id, owner_disp, ctype, _day(rng, opened, END).isoformat(), limit))
        # transactions: a running balance that starts with an opening deposit
        n = rng.randint(4, 46)
        days = sorted(_day(rng, opened, END) for _ in range(n - 1))
        days.insert(0, opened)
        balance = 0.0
        for k, d in enumerate(days):
            trans_id += 1
            if k == 0:
                ttype, op, amount, ksym = (
                    "credit",
                    "cash deposit",
                    round(rng.uniform(300, 9000), 2),
                    None,
                )
            elif rng.random() < 0.5 or balance < 200:
                ttype = "credit"
                op, ksym = rng.choices(
                    [
                        ("cash deposit", None),
                        ("transfer in", "salary"),
                        ("transfer in", "pension"),
                        ("interest", "interest"),
                        (None, None),
                    ],
                    [3, 5, 1, 1, 1],
                )[0]
                amount = round(
                    rng.uniform(1.5, 60) if op == "interest" else rng.uniform(50, 6000), 2
                )
            else:
                ttype = "debit"
                op, ksym = rng.choices(
                    [
                        ("cash withdrawal", None),
                        ("card payment", "household"),
                        ("transfer out", "rent"),
                        ("transfer out", "insurance"),
                        ("transfer out", "loan payment"),
                        (None, "fee"),
                    ],
                    [4, 4, 2, 1, 1, 1],
                )[0]
                amount = round(
                    min(rng.uniform(5, 3000), balance)
                    if ksym != "fee"
                    else rng.choice([2.5, 5.0, 15.0]),
                    2,
                )
            balance = round(balance + (amount if ttype == "credit" else -amount), 2)
            bank_to = account_to = None
            if op in ("transfer out", "transfer in") and rng.random() < 0.9:
                bank_to = rng.choice(_BANKS)
                account_to = rng.randint(10_000_000, 99_999_999)
            trans.append(
                (
                    trans_id,
                    acc,
                    d.isoformat(),
                    ttype,
                    op,
                    amount,
                    balance,
                    ksym,
                    bank_to,
                    account_to,
                )
            )
        status, closed = "active", None
        r = rng.random()
        if r < 0.03:
            status = "frozen"
        elif r < 0.07:
            status, closed = "closed", _day(rng, days[-1], END).isoformat()
        accounts.append(
            (
                acc,
                rng.randint(1, N_DISTRICTS),
                frequency,
                opened.isoformat(),
                status,
                closed,
                balance,
            )
        )
        if rng.random() < 0.16:
            loan_id += 1
            granted = _day(rng, opened, datetime.date(2023, 10, 31))
            amount = float(rng.randrange(6_000, 480_000, 500))
            duration = rng.choice([12, 24, 36, 48, 60])
            payments = round(amount / duration, 2)
            end = _add_months(granted, duration)
            if rng.random() < 0.03:
                lstatus, lclosed = None, None  # application still pending
            elif end <= END:
                lstatus = "A" if rng.random() < 0.88 else "B"
                lclosed = end.isoformat()
            else:
                lstatus = "C" if rng.random() < 0.9 else "D"
                lclosed = None
            loans.append(
                (loan_id, acc, granted.isoformat(), amount, duration, payments, lstatus, lclosed)
            )

    conn.executemany("INSERT INTO accounts VALUES (?,?,?,?,?,?,?)", accounts)
    conn.executemany("INSERT INTO dispositions VALUES (?,?,?,?)", disps)
    conn.executemany("INSERT INTO cards VALUES (?,?,?,?,?)", cards)
    conn.executemany("INSERT INTO loans VALUES (?,?,?,?,?,?,?,?)", loans)
    conn.executemany("INSERT INTO transactions VALUES (?,?,?,?,?,?,?,?,?,?)", trans)
    for stmt in POST_SCHEMA:
        conn.execute(stmt)

"""school_district: public schools, free/reduced-price meal counts, SAT results and districts.

In the style of BIRD's ``california_schools``: 14-digit CDS codes as TEXT keys, a ``frpm`` table
with awkward quoted column names ("Free Meal Count (K-12)", "Enrollment (K-12)", ...) for two
academic years, SAT averages with NULLs for small schools, dates as TEXT, REAL ratios, a view and
an audit trigger on school status changes. About 3 MB.
"""

from __future__ import annotations

import random
import sqlite3
from datetime import date, timedelta

DB_ID = "school_district"
VERSION = 1

SEED = 4242
YEARS = ["2013-2014", "2014-2015"]

SCHEMA = [
    """CREATE TABLE districts (
    "District Code" TEXT PRIMARY KEY,
    "District Name" TEXT NOT NULL,
    "County Name" TEXT NOT NULL,
    "District Type" TEXT NOT NULL,
    Superintendent TEXT,
    Phone TEXT,
    "Budget (USD)" REAL,
    Established TEXT
)""",
    """CREATE TABLE schools (
    CDSCode TEXT PRIMARY KEY,
    "District Code" TEXT NOT NULL REFERENCES districts ("District Code"),
    NCESSchool TEXT,
    StatusType TEXT NOT NULL,
    County TEXT NOT NULL,
    District TEXT NOT NULL,
    School TEXT NOT NULL,
    Street TEXT,
    City TEXT,
    Zip TEXT,
    State TEXT NOT NULL DEFAULT 'CA',
    Phone TEXT,
    Website TEXT,
    OpenDate TEXT,
    ClosedDate TEXT,
    Charter INTEGER,
    CharterNum TEXT,
    FundingType TEXT,
    SOCType TEXT,
    EdOpsName TEXT,
    GSoffered TEXT,
    Virtual TEXT,
    Magnet INTEGER,
    Latitude REAL,
    Longitude REAL,
    AdmFName TEXT,
    AdmLName TEXT,
    AdmEmail TEXT,
    LastUpdate TEXT NOT NULL
)""",
    """CREATE TABLE frpm (
    CDSCode TEXT NOT NULL REFERENCES schools (CDSCode) ON DELETE CASCADE,
    "Academic Year" TEXT NOT NULL,
    "County Name" TEXT,
    "District Name" TEXT,
    "School Name" TEXT,
    "School Type" TEXT,
    "Educational Option Type" TEXT,
    "NSLP Provision Status" TEXT,
    "Charter School (Y/N)" INTEGER,
    "Low Grade" TEXT,
    "High Grade" TEXT,
    "Enrollment (K-12)" REAL,
    "Free Meal Count (K-12)" REAL,
    "Percent (%) Eligible Free (K-12)" REAL,
    "FRPM Count (K-12)" REAL,
    "Percent (%) Eligible FRPM (K-12)" REAL,
    "Enrollment (Ages 5-17)" REAL,
    "Free Meal Count (Ages 5-17)" REAL,
    "Percent (%) Eligible Free (Ages 5-17)" REAL,
    PRIMARY KEY (CDSCode, "Academic Year")
)""",
    """CREATE TABLE satscores (
    cds TEXT PRIMARY KEY REFERENCES schools (CDSCode) ON DELETE CASCADE,
    rtype TEXT NOT NULL,
    sname TEXT,
    dname TEXT,
    cname TEXT,
    enroll12 INTEGER NOT NULL,
    NumTstTakr INTEGER NOT NULL,
    AvgScrRead INTEGER,
    AvgScrMath INTEGER,
    AvgScrWrite INTEGER,
    NumGE1500 INTEGER
)""",
    """CREATE TABLE school_status_log (
    log_id INTEGER PRIMARY KEY,
    CDSCode TEXT NOT NULL,
    old_status TEXT,
    new_status TEXT,
    changed_on TEXT NOT NULL
)""",
]

INDEXES = [
    'CREATE INDEX idx_schools_district ON schools ("District Code")',
    "CREATE INDEX idx_schools_county ON schools (County)",
    'CREATE INDEX idx_frpm_year ON frpm ("Academic Year")',
    "CREATE INDEX idx_status_log_school ON school_status_log (CDSCode)",
]

VIEWS_AND_TRIGGERS = [
    """CREATE VIEW v_school_meals AS
SELECT s.CDSCode, s.School, s.District, s.County, s.Charter, f."Academic Year",
       f."Enrollment (K-12)", f."Free Meal Count (K-12)",
       f."Free Meal Count (K-12)" / f."Enrollment (K-12)" AS free_meal_rate
FROM schools AS s
JOIN frpm AS f ON f.CDSCode = s.CDSCode
WHERE s.StatusType = 'Active'""",
    """CREATE TRIGGER trg_schools_status AFTER UPDATE OF StatusType ON schools
WHEN OLD.StatusType IS NOT NEW.StatusType
BEGIN
    INSERT INTO school_status_log (CDSCode, old_status, new_status, changed_on)
    VALUES (NEW.CDSCode, OLD.StatusType, NEW.StatusType, date('now'));
END""",
]

COUNTIES = [
    ("01", "Alameda"),
    ("07", "Contra Costa"),
    ("10", "Fresno"),
    ("15", "Kern"),
    ("19", "Los Angeles"),
    ("24", "Merced"),
    ("27", "Monterey"),
    ("30", "Orange"),
    ("31", "Placer"),
    ("33", "Riverside"),
    ("34", "Sacramento"),
    ("36", "San Bernardino"),
    ("37", "San Diego"),
    ("38", "San Francisco"),
    ("39", "San Joaquin"),
    ("41", "San Mateo"),
    ("42", "Santa Barbara"),
    ("43", "Santa Clara"),
    ("44", "Santa Cruz"),
    ("48", "Solano"),
    ("49", "Sonoma"),
    ("50", "Stanislaus"),
    ("54", "Tulare"),
    ("56", "Ventura"),
]
TOWNS = [
    "Oakview",
    "Riverbend",
    "Cedar Grove",
    "Mission Hills",
    "Sierra Vista",
    "Palm Valley",
    "Harbor City",
    "Granite Bay",
    "Willow Creek",
    "Sunnyside",
    "Lakeport",
    "Redwood Flats",
    "Mesa Verde",
    "Golden Hills",
    "Fairmont",
    "Valley Springs",
    "Pacific Grove",
    "El Camino",
    "Santa Rita",
    "Los Robles",
    "Buena Park",
    "Twin Oaks",
    "Clearwater",
    "Pine Ridge",
]
DTYPES = (
    ["Unified School District"] * 5
    + ["Elementary School District"] * 3
    + ["High School District"] * 2
)
PEOPLE_F = [
    "Maria",
    "Jose",
    "Linda",
    "David",
    "Susan",
    "Michael",
    "Karen",
    "Carlos",
    "Jennifer",
    "Robert",
    "Ana",
    "Kevin",
    "Laura",
    "Daniel",
    "Patricia",
    "Thomas",
    "Grace",
    "Victor",
]
PEOPLE_L = [
    "Garcia",
    "Nguyen",
    "Smith",
    "Lopez",
    "Johnson",
    "Martinez",
    "Kim",
    "Brown",
    "Hernandez",
    "Wilson",
    "Chen",
    "Davis",
    "Ramirez",
    "Patel",
    "Anderson",
    "Flores",
    "Okafor",
    "Silva",
]
PATRONS = [
    "Lincoln",
    "Washington",
    "Jefferson",
    "Roosevelt",
    "Cesar Chavez",
    "Kennedy",
    "Madison",
    "Franklin",
    "Sequoia",
    "Oak Grove",
    "Vista Del Mar",
    "Hillside",
    "Parkview",
    "Sunrise",
    "Mountain View",
    "Valley Oak",
    "Harriet Tubman",
    "Rosa Parks",
    "John Muir",
    "Sycamore",
    "Del Norte",
    "Bayside",
    "Meadowbrook",
    "Eastside",
    "Westwood",
    "Northgate",
    "Monte Vista",
]
KINDS = [
    # (SOCType, name suffix, low, high, weight)
    ("Elementary Schools (Public)", "Elementary", "K", "5", 50),
    ("Intermediate/Middle Schools (Public)", "Middle", "6", "8", 16),
    ("High Schools (Public)", "High", "9", "12", 16),
    ("K-12 Schools (Public)", "Academy", "K", "12", 5),
    ("Continuation High Schools", "Continuation High", "10", "12", 5),
    ("Elementary-High Combination", "Charter School", "K", "12", 4),
    ("Preschool", "Preschool", "P", "K", 4),
]
EDOPS = ["Traditional"] * 12 + [
    "Alternative School of Choice",
    "Community Day School",
    "Special Education School",
]


def _districts(rng):
    code = 0
    for ccode, county in COUNTIES:
        used = set()
        for k in range(rng.randint(4, 8)):
            code += 1
            dtype = DTYPES[rng.randrange(10)]
            dcode = f"{ccode}{61000 + code * 13:05d}"
            shift = 0
            while f"{TOWNS[(code * 7 + k + shift) % len(TOWNS)]} {dtype}" in used:
                shift += 1
            name = f"{TOWNS[(code * 7 + k + shift) % len(TOWNS)]} {dtype}"
            used.add(name)
            if k == 0 and rng.random() < 0.4:
                name, dtype = (
                    f"{county} County Office of Education",
                    "County Office of Education (COE)",
                )
            sup = None if rng.random() < 0.1 else f"{rng.choice(PEOPLE_F)} {rng.choice(PEOPLE_L)}"
            phone = (
                None
                if rng.random() < 0.12
                else f"({rng.randint(209, 951)}) {rng.randint(200, 999)}-{rng.randint(0, 9999):04d}"
            )
            budget = None if rng.random() < 0.08 else round(rng.uniform(4e6, 9e8), 2)
            est = date(1890, 1, 1) + timedelta(days=rng.randrange(40000))
            yield dcode, name, county, dtype, sup, phone, budget, est.isoformat()


def _schools(rng, districts, kinds_out):
    weights = [k[4] for k in KINDS]
    serial = 0
    for dcode, dname, county, dtype, *_ in districts:
        for _ in range(rng.randint(6, 40)):
            serial += 1
            kind = rng.choices(KINDS, weights)[0]
            if dtype == "High School District" and kind[1] in ("Elementary", "Preschool"):
                kind = KINDS[2]
            elif dtype == "Elementary School District" and kind[1] in (
                "High",
                "Continuation High",
                "Academy",
            ):
                kind = KINDS[1]
            cds = f"{dcode}{6000000 + serial * 17:07d}"
            name = f"{rng.choice(PATRONS)} {kind[1]}"
            if rng.random() < 0.04:
                name += " "  # trailing space, as in the state export
            status = rng.choices(["Active", "Closed", "Merged", "Pending"], [85, 10, 4, 1])[0]
            opened = date(1950, 1, 1) + timedelta(days=rng.randrange(23000))
            closed = None
            if status in ("Closed", "Merged"):
                closed_on = date(1985, 1, 1) + timedelta(days=rng.randrange(11000))
                opened = min(opened, closed_on - timedelta(days=rng.randrange(900, 9000)))
                closed = closed_on.isoformat()
            charter = 1 if kind[1] == "Charter School" or rng.random() < 0.1 else 0
            if rng.random() < 0.03:
                charter = None
            charter_num = f"{rng.randint(1, 1999):04d}" if charter == 1 else None
            funding = rng.choice(["Directly funded", "Locally funded"]) if charter == 1 else None
            town = dname.split(" ")[0] if "County" not in dname else county
            lat = None if rng.random() < 0.05 else round(rng.uniform(32.6, 41.9), 6)
            lon = None if lat is None else round(rng.uniform(-124.2, -114.3), 6)
            first, last = rng.choice(PEOPLE_F), rng.choice(PEOPLE_L)
            email = (
                None
                if rng.random() < 0.2
                else f"{first[0].lower()}{last.lower()}@{dname.split()[0].lower()}.k12.ca.us"
            )
            web = (
                None
                if rng.random() < 0.35
                else f"http://www.{name.strip().split()[0].lower()}{serial}.org"
            )
            phone = (
                None
                if rng.random() < 0.25
                else f"({rng.randint(209, 951)}) {rng.randint(200, 999)}-{rng.randint(0, 9999):04d}"
            )
            updated = date(2014, 6, 1) + timedelta(days=rng.randrange(700))
            kinds_out.append((cds, kind, status, charter, name, dname, county))
            yield (
                cds,
                dcode,
                f"{rng.randint(0, 99999):05d}" if rng.random() > 0.1 else None,
                status,
                county,
                dname,
                name,
                f"{rng.randint(10, 9999)} {rng.choice(['Elm', 'Oak', 'School', 'Main', 'Mission'])} St",
                town,
                f"9{rng.randint(1000, 6199):04d}",
                "CA",
                phone,
                web,
                opened.isoformat(),
                closed,
                charter,
                charter_num,
                funding,
                kind[0],
                EDOPS[rng.randrange(len(EDOPS))]
                if kind[1] != "Continuation High"
                else "Continuation School",
                f"{kind[2]}-{kind[3]}",
                rng.choices(["N", "P", "F", None], [85, 6, 4, 5])[0],
                None if rng.random() < 0.3 else (1 if rng.random() < 0.08 else 0),
                lat,
                lon,
                first,
                last,
                email,
                updated.isoformat(),
            )


def _frpm(rng, kinds):
    for cds, kind, status, charter, name, dname, county in kinds:
        if status == "Pending" or kind[1] == "Preschool":
            continue
        base = {
            "Elementary": 480,
            "Middle": 750,
            "High": 1500,
            "Academy": 600,
            "Continuation High": 120,
            "Charter School": 350,
        }[kind[1]]
        enroll = max(8, int(rng.gauss(base, base * 0.35)))
        rate = min(0.98, max(0.02, rng.betavariate(2.2, 2.0)))
        years = YEARS if status == "Active" else YEARS[:1] if rng.random() < 0.7 else []
        for year in years:
            e = float(max(5, int(enroll * rng.uniform(0.93, 1.07))))
            free = float(int(e * min(0.99, rate * rng.uniform(0.9, 1.1))))
            frpm_count = float(min(e, int(free * rng.uniform(1.05, 1.25))))
            e517 = float(int(e * rng.uniform(0.9, 0.99)))
            free517 = float(min(e517, int(free * rng.uniform(0.9, 0.99))))
            nslp = rng.choices(
                [None, "Provision 2", "CEP", "Breakfast Provision 2"], [80, 8, 10, 2]
            )[0]
            if rng.random() < 0.02:
                free = None  # suppressed for privacy
            yield (
                cds,
                year,
                county,
                dname,
                name.strip(),
                kind[0],
                "Traditional",
                nslp,
                charter,
                kind[2],
                kind[3],
                e,
                free,
                None if free is None else free / e,
                frpm_count,
                frpm_count / e,
                e517,
                free517,
                free517 / e517 if e517 else None,
            )


def _sat(rng, kinds):
    for cds, kind, status, _charter, name, dname, county in kinds:
        if kind[1] not in ("High", "Continuation High", "Academy") or status == "Pending":
            continue
        if rng.random() < 0.1:
            continue
        enroll12 = max(
            3, int(rng.gauss(380 if kind[1] == "High" else 60, 120 if kind[1] == "High" else 30))
        )
        takers = int(enroll12 * rng.uniform(0.05, 0.75))
        if takers < 12:
            # too few test takers: scores suppressed
            yield cds, "S", name, dname, county, enroll12, takers, None, None, None, None
            continue
        level = rng.gauss(480, 55)
        read = int(level + rng.gauss(0, 15))
        math = int(level + rng.gauss(8, 20))
        write = int(level + rng.gauss(-8, 15))
        ge1500 = int(takers * min(0.95, max(0.0, (read + math + write - 1250) / 800)))
        yield cds, "S", name, dname, county, enroll12, takers, read, math, write, ge1500


def build(conn: sqlite3.Connection) -> None:
    """Fill an empty database inside the caller's open transaction."""
    rng = random.Random(SEED)
    for stmt in SCHEMA:
        conn.execute(stmt)
    districts = list(_districts(rng))
    conn.executemany("INSERT INTO districts VALUES (?, ?, ?, ?, ?, ?, ?, ?)", districts)
    kinds: list[tuple] = []
    conn.executemany(
        f"INSERT INTO schools VALUES ({', '.join('?' * 29)})", _schools(rng, districts, kinds)
    )
    conn.executemany(f"INSERT INTO frpm VALUES ({', '.join('?' * 19)})", _frpm(rng, kinds))
    conn.executemany(f"INSERT INTO satscores VALUES ({', '.join('?' * 11)})", _sat(rng, kinds))
    log = []
    for cds, _kind, status, *_ in kinds:
        if status in ("Closed", "Merged") and len(log) < 120:
            log.append((cds, "Active", status, f"20{13 + len(log) % 3}-0{1 + len(log) % 9}-15"))
    conn.executemany(
        "INSERT INTO school_status_log (CDSCode, old_status, new_status, changed_on) VALUES (?, ?, ?, ?)",
        log,
    )
    for stmt in INDEXES + VIEWS_AND_TRIGGERS:
        conn.execute(stmt)
    conn.execute("ANALYZE")

"""``formula_racing``: a motor-racing championship database in the style of BIRD's ``formula_1``.

Seasons 2012-2023 with circuits, races (``date``/``time`` as TEXT, ``time`` sometimes NULL),
drivers (MixedCase columns such as ``"driverRef"``, ``dob`` as TEXT, ``number``/``code`` NULL for
older drivers), constructors, qualifying (``q2``/``q3`` NULL when knocked out), results (``position``
NULL for a DNF, ``points`` REAL, ``"fastestLapTime"`` TEXT like ``'1:23.456'``), pit stops and lap
times (2019 onwards). Races carry a JSON ``session_info`` column; circuits have a column with a
space (``"Track Length km"``). One view (``v_race_winners``) and one trigger
(``trg_results_points_audit``) writing to ``"pointsAudit"``.
"""

from __future__ import annotations

import json
import random
import sqlite3
from datetime import date, timedelta

DB_ID = "formula_racing"
VERSION = 1

SEED = 19500513
SEASONS = range(2012, 2024)
LAP_TIME_SEASONS = range(2019, 2024)

SCHEMA = [
    """CREATE TABLE circuits (
        "circuitId" INTEGER PRIMARY KEY,
        "circuitRef" TEXT NOT NULL,
        name TEXT NOT NULL,
        location TEXT,
        country TEXT,
        lat REAL,
        lng REAL,
        alt INTEGER,
        "Track Length km" REAL,
        url TEXT
    )""",
    """CREATE TABLE seasons (
        year INTEGER PRIMARY KEY,
        url TEXT
    )""",
    """CREATE TABLE races (
        "raceId" INTEGER PRIMARY KEY,
        year INTEGER NOT NULL REFERENCES seasons(year),
        round INTEGER NOT NULL,
        "circuitId" INTEGER NOT NULL REFERENCES circuits("circuitId"),
        name TEXT NOT NULL,
        date TEXT NOT NULL,
        time TEXT,
        laps_scheduled INTEGER,
        session_info TEXT,
        url TEXT
    )""",
    """CREATE TABLE drivers (
        "driverId" INTEGER PRIMARY KEY,
        "driverRef" TEXT NOT NULL,
        number INTEGER,
        code TEXT,
        forename TEXT NOT NULL,
        surname TEXT NOT NULL,
        dob TEXT,
        nationality TEXT,
        url TEXT
    )""",
    """CREATE TABLE constructors (
        "constructorId" INTEGER PRIMARY KEY,
        "constructorRef" TEXT NOT NULL,
        name TEXT NOT NULL UNIQUE,
        nationality TEXT,
        url TEXT
    )""",
    """CREATE TABLE status (
        "statusId" INTEGER PRIMARY KEY,
        status TEXT NOT NULL
    )""",
    """CREATE TABLE qualifying (
        "qualifyId" INTEGER PRIMARY KEY,
        "raceId" INTEGER NOT NULL REFERENCES races("raceId"),
        "driverId" INTEGER NOT NULL REFERENCES drivers("driverId"),
        "constructorId" INTEGER NOT NULL REFERENCES constructors("constructorId"),
        number INTEGER,
        position INTEGER,
        q1 TEXT,
        q2 TEXT,
        q3 TEXT
    )""",
    """CREATE TABLE results (
        "resultId" INTEGER PRIMARY KEY,
        "raceId" INTEGER NOT NULL REFERENCES races("raceId"),
        "driverId" INTEGER NOT NULL REFERENCES drivers("driverId"),
        "constructorId" INTEGER NOT NULL REFERENCES constructors("constructorId"),
        number INTEGER,
        grid INTEGER NOT NULL,
        position INTEGER,
        "positionText" TEXT NOT NULL,
        "positionOrder" INTEGER NOT NULL,
        points REAL NOT NULL DEFAULT 0,
        laps INTEGER NOT NULL,
        time TEXT,
        milliseconds INTEGER,
        "fastestLap" INTEGER,
        rank INTEGER,
        "fastestLapTime" TEXT,
        "fastestLapSpeed" TEXT,
        "statusId" INTEGER NOT NULL REFERENCES status("statusId")
    )""",
    """CREATE TABLE "pitStops" (
        "raceId" INTEGER NOT NULL REFERENCES races("raceId"),
        "driverId" INTEGER NOT NULL REFERENCES drivers("driverId"),
        stop INTEGER NOT NULL,
        lap INTEGER NOT NULL,
        time TEXT NOT NULL,
        duration TEXT,
        milliseconds INTEGER,
        PRIMARY KEY ("raceId", "driverId", stop)
    )""",
    """CREATE TABLE "lapTimes" (
        "raceId" INTEGER NOT NULL REFERENCES races("raceId"),
        "driverId" INTEGER NOT NULL REFERENCES drivers("driverId"),
        lap INTEGER NOT NULL,
        position INTEGER,
        time TEXT,
        milliseconds INTEGER,
        PRIMARY KEY ("raceId", "driverId", lap)
    )""",
    """CREATE TABLE "driverStandings" (
        "driverStandingsId" INTEGER PRIMARY KEY,
        "raceId" INTEGER NOT NULL REFERENCES races("raceId"),
        "driverId" INTEGER NOT NULL REFERENCES drivers("driverId"),
        points REAL NOT NULL,
        position INTEGER,
        "positionText" TEXT,
        wins INTEGER NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE "pointsAudit" (
        "auditId" INTEGER PRIMARY KEY AUTOINCREMENT,
        "resultId" INTEGER NOT NULL,
        old_points REAL,
        new_points REAL,
        changed_at TEXT NOT NULL DEFAULT (datetime('now'))
    )""",
    'CREATE INDEX "idx_results_race" ON results("raceId")',
    'CREATE INDEX "idx_results_driver" ON results("driverId")',
    'CREATE INDEX "idx_races_year" ON races(year, round)',
    'CREATE INDEX "idx_qualifying_race" ON qualifying("raceId")',
    'CREATE INDEX "idx_lapTimes_driver" ON "lapTimes"("driverId")',
    'CREATE INDEX "idx_driverStandings_race" ON "driverStandings"("raceId", "driverId")',
    """CREATE VIEW v_race_winners AS
        SELECT ra."raceId", ra.year, ra.round, ra.name AS race_name, ra.date,
               d.forename || ' ' || d.surname AS winner, c.name AS constructor,
               r.grid, r.laps, r.time AS race_time
        FROM results r
        JOIN races ra ON ra."raceId" = r."raceId"
        JOIN drivers d ON d."driverId" = r."driverId"
        JOIN constructors c ON c."constructorId" = r."constructorId"
        WHERE r.position = 1""",
    """CREATE TRIGGER trg_results_points_audit
        AFTER UPDATE OF points ON results
        WHEN OLD.points <> NEW.points
        BEGIN
            INSERT INTO "pointsAudit" ("resultId", old_points, new_points)
            VALUES (NEW."resultId", OLD.points, NEW.points);
        END""",
]

# ref, name, location, country, lat, lng, alt, length km, base lap seconds, laps
CIRCUITS = [
    (
        "albert_park",
        "Albert Park Grand Prix Circuit",
        "Melbourne",
        "Australia",
        -37.8497,
        144.968,
        10,
        5.278,
        80.2,
        58,
    ),
    (
        "bahrain",
        "Bahrain International Circuit",
        "Sakhir",
        "Bahrain",
        26.0325,
        50.5106,
        7,
        5.412,
        92.5,
        57,
    ),
    (
        "shanghai",
        "Shanghai International Circuit",
        "Shanghai",
        "China",
        31.3389,
        121.22,
        5,
        5.451,
        95.1,
        56,
    ),
    ("baku", "Baku City Circuit", "Baku", "Azerbaijan", 40.3725, 49.8533, -7, 6.003, 103.0, 51),
    (
        "catalunya",
        "Circuit de Barcelona-Catalunya",
        "Montmeló",
        "Spain",
        41.57,
        2.26111,
        109,
        4.657,
        78.9,
        66,
    ),
    ("monaco", "Circuit de Monaco", "Monte-Carlo", "Monaco", 43.7347, 7.42056, 7, 3.337, 74.3, 78),
    (
        "villeneuve",
        "Circuit Gilles Villeneuve",
        "Montreal",
        "Canada",
        45.5,
        -73.5228,
        13,
        4.361,
        74.9,
        70,
    ),
    (
        "red_bull_ring",
        "Red Bull Ring",
        "Spielberg",
        "Austria",
        47.2197,
        14.7647,
        678,
        4.318,
        67.5,
        71,
    ),
    (
        "silverstone",
        "Silverstone Circuit",
        "Silverstone",
        "UK",
        52.0786,
        -1.01694,
        153,
        5.891,
        89.0,
        52,
    ),
    ("hungaroring", "Hungaroring", "Budapest", "Hungary", 47.5789, 19.2486, 264, 4.381, 79.5, 70),
    (
        "spa",
        "Circuit de Spa-Francorchamps",
        "Spa",
        "Belgium",
        50.4372,
        5.97139,
        401,
        7.004,
        108.0,
        44,
    ),
    (
        "zandvoort",
        "Circuit Park Zandvoort",
        "Zandvoort",
        "Netherlands",
        52.3888,
        4.54092,
        6,
        4.259,
        73.8,
        72,
    ),
    (
        "monza",
        "Autodromo Nazionale di Monza",
        "Monza",
        "Italy",
        45.6156,
        9.28111,
        162,
        5.793,
        83.0,
        53,
    ),
    (
        "marina_bay",
        "Marina Bay Street Circuit",
        "Marina Bay",
        "Singapore",
        1.2914,
        103.864,
        18,
        4.94,
        99.5,
        62,
    ),
    ("suzuka", "Suzuka Circuit", "Suzuka", "Japan", 34.8431, 136.541, 45, 5.807, 92.0, 53),
    (
        "americas",
        "Circuit of the Americas",
        "Austin",
        "USA",
        30.1328,
        -97.6411,
        None,
        5.513,
        98.0,
        56,
    ),
    (
        "rodriguez",
        "Autódromo Hermanos Rodríguez",
        "Mexico City",
        "Mexico",
        19.4042,
        -99.0907,
        2227,
        4.304,
        80.1,
        71,
    ),
    (
        "interlagos",
        "Autódromo José Carlos Pace",
        "São Paulo",
        "Brazil",
        -23.7036,
        -46.6997,
        785,
        4.309,
        72.0,
        71,
    ),
    ("yas_marina", "Yas Marina Circuit", "Abu Dhabi", "UAE", 24.4672, 54.6031, 3, 5.281, 88.5, 58),
    ("sochi", "Sochi Autodrom", "Sochi", "Russia", 43.4057, 39.9578, 2, 5.848, 97.5, 53),
    (
        "jeddah",
        "Jeddah Corniche Circuit",
        "Jeddah",
        "Saudi Arabia",
        21.6319,
        39.1044,
        15,
        6.174,
        91.5,
        50,
    ),
    (
        "losail",
        "Losail International Circuit",
        "Al Daayen",
        "Qatar",
        25.49,
        51.4542,
        None,
        5.419,
        85.0,
        57,
    ),
    (
        "miami",
        "Miami International Autodrome",
        "Miami",
        "USA",
        25.9581,
        -80.2389,
        None,
        5.412,
        91.0,
        57,
    ),
    (
        "imola",
        "Autodromo Enzo e Dino Ferrari",
        "Imola",
        "Italy",
        44.3439,
        11.7167,
        37,
        4.909,
        78.0,
        63,
    ),
    (
        "sepang",
        "Sepang International Circuit",
        "Kuala Lumpur",
        "Malaysia",
        2.76083,
        101.738,
        18,
        5.543,
        98.5,
        56,
    ),
    (
        "hockenheimring",
        "Hockenheimring",
        "Hockenheim",
        "Germany",
        49.3278,
        8.56583,
        103,
        4.574,
        76.0,
        67,
    ),
    (
        "las_vegas",
        "Las Vegas Strip Street Circuit",
        "Las Vegas",
        "USA",
        36.1147,
        -115.173,
        None,
        6.201,
        96.0,
        50,
    ),
]

# name, ref, nationality, strength
CONSTRUCTORS = [
    ("Mercedes", "mercedes", "German", 0.95),
    ("Red Bull", "red_bull", "Austrian", 0.93),
    ("Ferrari", "ferrari", "Italian", 0.88),
    ("McLaren", "mclaren", "British", 0.75),
    ("Alpine F1 Team", "alpine", "French", 0.62),
    ("Aston Martin", "aston_martin", "British", 0.64),
    ("Williams", "williams", "British", 0.45),
    ("AlphaTauri", "alphatauri", "Italian", 0.5),
    ("Alfa Romeo", "alfa", "Swiss", 0.46),
    ("Haas F1 Team", "haas", "American", 0.44),
    ("Renault", "renault", "French", 0.6),
    ("Force India", "force_india", "Indian", 0.58),
    ("Toro Rosso", "toro_rosso", "Italian", 0.48),
    ("Sauber", "sauber", "Swiss", 0.42),
    ("Lotus F1", "lotus_f1", "British", 0.6),
]
# team lineups: for each season the 10 constructors (by name)
TEAMS_EARLY = [
    "Mercedes",
    "Red Bull",
    "Ferrari",
    "McLaren",
    "Lotus F1",
    "Force India",
    "Williams",
    "Toro Rosso",
    "Sauber",
    "Renault",
]
TEAMS_MID = [
    "Mercedes",
    "Red Bull",
    "Ferrari",
    "McLaren",
    "Renault",
    "Force India",
    "Williams",
    "Toro Rosso",
    "Sauber",
    "Haas F1 Team",
]
TEAMS_LATE = [
    "Mercedes",
    "Red Bull",
    "Ferrari",
    "McLaren",
    "Alpine F1 Team",
    "Aston Martin",
    "Williams",
    "AlphaTauri",
    "Alfa Romeo",
    "Haas F1 Team",
]

# forename, surname, nationality, dob, number, code, skill
DRIVERS = [
    ("Lewis", "Hamilton", "British", "1985-01-07", 44, "HAM", 0.97),
    ("Max", "Verstappen", "Dutch", "1997-09-30", 33, "VER", 0.98),
    ("Sebastian", "Vettel", "German", "1987-07-03", 5, "VET", 0.9),
    ("Fernando", "Alonso", "Spanish", "1981-07-29", 14, "ALO", 0.93),
    ("Kimi", "Räikkönen", "Finnish", "1979-10-17", 7, "RAI", 0.85),
    ("Valtteri", "Bottas", "Finnish", "1989-08-28", 77, "BOT", 0.86),
    ("Daniel", "Ricciardo", "Australian", "1989-07-01", 3, "RIC", 0.87),
    ("Charles", "Leclerc", "Monegasque", "1997-10-16", 16, "LEC", 0.92),
    ("Lando", "Norris", "British", "1999-11-13", 4, "NOR", 0.89),
    ("Carlos", "Sainz", "Spanish", "1994-09-01", 55, "SAI", 0.88),
    ("Sergio", "Pérez", "Mexican", "1990-01-26", 11, "PER", 0.86),
    ("George", "Russell", "British", "1998-02-15", 63, "RUS", 0.89),
    ("Esteban", "Ocon", "French", "1996-09-17", 31, "OCO", 0.82),
    ("Pierre", "Gasly", "French", "1996-02-07", 10, "GAS", 0.83),
    ("Lance", "Stroll", "Canadian", "1998-10-29", 18, "STR", 0.76),
    ("Nico", "Hülkenberg", "German", "1987-08-19", 27, "HUL", 0.82),
    ("Kevin", "Magnussen", "Danish", "1992-10-05", 20, "MAG", 0.78),
    ("Yuki", "Tsunoda", "Japanese", "2000-05-11", 22, "TSU", 0.79),
    ("Alexander", "Albon", "Thai", "1996-03-23", 23, "ALB", 0.81),
    ("Zhou", "Guanyu", "Chinese", "1999-05-30", 24, "ZHO", 0.74),
    ("Oscar", "Piastri", "Australian", "2001-04-06", 81, "PIA", 0.86),
    ("Logan", "Sargeant", "American", "2000-12-31", 2, "SAR", 0.65),
    ("Nyck", "de Vries", "Dutch", "1995-02-06", 21, "DEV", 0.7),
    ("Mick", "Schumacher", "German", "1999-03-22", 47, "MSC", 0.7),
    ("Nicholas", "Latifi", "Canadian", "1995-06-29", 6, "LAT", 0.64),
    ("Antonio", "Giovinazzi", "Italian", "1993-12-14", 99, "GIO", 0.71),
    ("Nikita", "Mazepin", "Russian", "1999-03-02", 9, "MAZ", 0.6),
    ("Romain", "Grosjean", "French", "1986-04-17", 8, "GRO", 0.79),
    ("Daniil", "Kvyat", "Russian", "1994-04-26", 26, "KVY", 0.75),
    ("Robert", "Kubica", "Polish", "1984-12-07", 88, "KUB", 0.68),
    ("Nico", "Rosberg", "German", "1985-06-27", 6, "ROS", 0.92),
    ("Jenson", "Button", "British", "1980-01-19", 22, "BUT", 0.86),
    ("Felipe", "Massa", "Brazilian", "1981-04-25", 19, "MAS", 0.8),
    ("Mark", "Webber", "Australian", "1976-08-27", None, "WEB", 0.84),
    ("Romain", "Dumas", "French", "1977-12-14", None, None, 0.6),
    ("Paul", "di Resta", "British", "1986-04-16", None, "DIR", 0.74),
    ("Pastor", "Maldonado", "Venezuelan", "1985-03-09", 13, "MAL", 0.7),
    ("Adrian", "Sutil", "German", "1983-01-11", 99, "SUT", 0.72),
    ("Jean-Éric", "Vergne", "French", "1990-04-25", 25, "VER", 0.72),
    ("Marcus", "Ericsson", "Swedish", "1990-09-02", 9, "ERI", 0.68),
    ("Felipe", "Nasr", "Brazilian", "1992-08-21", 12, "NAS", 0.68),
    ("Stoffel", "Vandoorne", "Belgian", "1992-03-26", 2, "VAN", 0.72),
    ("Brendon", "Hartley", "New Zealander", "1989-11-10", 28, "HAR", 0.66),
    ("Pascal", "Wehrlein", "German", "1994-10-18", 94, "WEH", 0.68),
    ("Jules", "Bianchi", "French", "1989-08-03", 17, "BIA", 0.72),
    ("Kamui", "Kobayashi", "Japanese", "1986-09-13", None, "KOB", 0.7),
    ("Heikki", "Kovalainen", "Finnish", "1981-10-19", None, "KOV", 0.68),
    ("Jolyon", "Palmer", "British", "1991-01-20", 30, "PAL", 0.64),
    ("Liam", "Lawson", "New Zealander", "2002-02-11", 40, "LAW", 0.75),
    ("Charles", "Pic", "French", "1990-02-15", None, "PIC", 0.6),
]

STATUSES = [
    "Finished",
    "Disqualified",
    "Accident",
    "Collision",
    "Engine",
    "Gearbox",
    "Transmission",
    "Clutch",
    "Hydraulics",
    "Electrical",
    "+1 Lap",
    "+2 Laps",
    "Spun off",
    "Radiator",
    "Suspension",
    "Brakes",
    "Power Unit",
    "Withdrew",
    "Retired",
]
DNF_STATUSES = [3, 4, 5, 6, 7, 9, 10, 13, 14, 15, 16, 17, 19]
POINTS = [25, 18, 15, 12, 10, 8, 6, 4, 2, 1]


def _lineup(year: int) -> list[tuple[str, list[int]]]:
    """Constructor name and its two driver ids (1-based) for a season."""
    teams = TEAMS_EARLY if year <= 2015 else (TEAMS_MID if year <= 2020 else TEAMS_LATE)
    by_year = {
        2012: [31, 1, 34, 3, 2, 4, 33, 32, 7, 39, 5, 50, 38, 36, 16, 46, 37, 29, 47, 45],
        2016: [31, 1, 7, 3, 5, 4, 42, 32, 16, 48, 11, 13, 6, 33, 2, 29, 40, 41, 28, 17],
        2019: [1, 6, 2, 19, 8, 3, 9, 10, 7, 16, 11, 15, 12, 30, 14, 29, 5, 26, 28, 17],
        2021: [1, 6, 2, 11, 8, 10, 9, 7, 4, 13, 3, 15, 12, 25, 14, 18, 5, 26, 24, 27],
        2022: [1, 12, 2, 11, 8, 10, 9, 7, 4, 13, 3, 15, 25, 19, 14, 18, 6, 20, 24, 17],
        2023: [1, 12, 2, 11, 8, 10, 9, 21, 14, 13, 4, 15, 19, 22, 23, 18, 6, 20, 16, 17],
    }
    key = max(k for k in by_year if k <= year)
    ids = by_year[key]
    return [(teams[i], ids[2 * i : 2 * i + 2]) for i in range(10)]


def _fmt_lap(ms: int) -> str:
    m, rest = divmod(ms, 60000)
    return f"{m}:{rest // 1000:02d}.{rest % 1000:03d}"


def _fmt_race(ms: int) -> str:
    h, rest = divmod(ms, 3600000)
    m, rest = divmod(rest, 60000)
    return f"{h}:{m:02d}:{rest // 1000:02d}.{rest % 1000:03d}"


def build(conn: sqlite3.Connection) -> None:
    rng = random.Random(SEED)
    for stmt in SCHEMA:
        conn.execute(stmt)

    conn.executemany(
        "INSERT INTO circuits VALUES (?,?,?,?,?,?,?,?,?,?)",
        (
            (
                i,
                c[0],
                c[1],
                c[2],
                c[3],
                c[4],
                c[5],
                c[6],
                c[7],
                f"http://en.wikipedia.org/wiki/{c[1].replace(' ', '_')}",
            )
            for i, c in enumerate(CIRCUITS, 1)
        ),
    )
    conn.executemany(
        "INSERT INTO seasons VALUES (?,?)",
        ((y, f"http://en.wikipedia.org/wiki/{y}_Formula_One_World_Championship") for y in SEASONS),
    )
    conn.executemany(
        "INSERT INTO drivers VALUES (?,?,?,?,?,?,?,?,?)",
        (
            (
                i,
                (
                    s.lower().replace(" ", "_")
                    if s != "Verstappen" and s != "Schumacher"
                    else ("max_verstappen" if s == "Verstappen" else "mick_schumacher")
                ),
                n,
                code,
                f,
                s,
                dob,
                nat,
                f"http://en.wikipedia.org/wiki/{f}_{s}".replace(" ", "_"),
            )
            for i, (f, s, nat, dob, n, code, _) in enumerate(DRIVERS, 1)
        ),
    )
    cons_id = {c[0]: i for i, c in enumerate(CONSTRUCTORS, 1)}
    conn.executemany(
        "INSERT INTO constructors VALUES (?,?,?,?,?)",
        (
            (i, ref, name, nat, f"http://en.wikipedia.org/wiki/{name.replace(' ', '_')}")
            for i, (name, ref, nat, _) in enumerate(CONSTRUCTORS, 1)
        ),
    )
    conn.executemany("INSERT INTO status VALUES (?,?)", enumerate(STATUSES, 1))

    skill = {i: d[6] for i, d in enumerate(DRIVERS, 1)}
    strength = {c[0]: c[3] for c in CONSTRUCTORS}
    race_rows, quali_rows, result_rows, pit_rows, lap_rows, stand_rows = [], [], [], [], [], []
    race_id = result_id = quali_id = stand_id = 0
    for year in SEASONS:
        n_rounds = 19 + (year - 2012) // 3 + (1 if year >= 2023 else 0)
        calendar = rng.sample(range(len(CIRCUITS)), n_rounds)
        first_sunday = date(year, 3, 10) + timedelta(days=(6 - date(year, 3, 10).weekday()))
        race_days = [
            first_sunday + timedelta(weeks=round(k * 36 / n_rounds)) for k in range(n_rounds)
        ]
        lineup = _lineup(year)
        standings: dict[int, list[float]] = {}
        for rnd, (ci, day) in enumerate(zip(calendar, race_days, strict=False), 1):
            race_id += 1
            circ = CIRCUITS[ci]
            start_hour = (
                13
                if circ[3] not in ("Singapore", "Bahrain", "UAE", "Saudi Arabia", "Qatar")
                else 17
            )
            race_time = (
                None
                if year <= 2013 and rng.random() < 0.5
                else f"{start_hour - 1 + rng.choice([0, 1]):02d}:{rng.choice(['00', '10'])}:00"
            )
            weather = rng.choice(["dry", "dry", "dry", "dry", "mixed", "wet"])
            info = {
                "weather": weather,
                "air_temp": round(rng.uniform(12, 36), 1),
                "track_temp": round(rng.uniform(20, 55), 1),
                "safety_cars": rng.choice([0, 0, 0, 1, 1, 2, 3]),
                "attendance": None if rng.random() < 0.2 else rng.randrange(60000, 360000, 1000),
            }
            laps_total = circ[9]
            race_rows.append(
                (
                    race_id,
                    year,
                    rnd,
                    ci + 1,
                    f"{circ[3] if circ[3] not in ('UK', 'USA', 'UAE') else {'UK': 'British', 'USA': 'United States', 'UAE': 'Abu Dhabi'}[circ[3]]} Grand Prix",
                    day.isoformat(),
                    race_time,
                    laps_total,
                    json.dumps(info, sort_keys=True),
                    f"http://en.wikipedia.org/wiki/{year}_{circ[3]}_Grand_Prix",
                )
            )

            entrants = []
            for team, ids in lineup:
                for j, did in enumerate(ids):
                    pace = (
                        strength[team] * 0.6
                        + skill[did] * 0.4
                        + rng.gauss(0, 0.05 if weather == "dry" else 0.09)
                    )
                    entrants.append((pace, did, team, j))
            base_ms = int(circ[8] * 1000)
            pace_by = {e[1]: e[0] for e in entrants}
            # qualifying
            quali = sorted(entrants, key=lambda e: -(e[0] + rng.gauss(0, 0.02)))
            grid = {}
            for qpos, (pace, did, team, _) in enumerate(quali, 1):
                quali_id += 1
                grid[did] = qpos
                q1 = base_ms - int((pace - 0.7) * 4000) + rng.randrange(0, 400)
                q2 = _fmt_lap(q1 - rng.randrange(50, 400)) if qpos <= 15 else None
                q3 = _fmt_lap(q1 - rng.randrange(300, 700)) if qpos <= 10 else None
                q1t = None if rng.random() < 0.01 else _fmt_lap(q1)
                quali_rows.append((quali_id, race_id, did, cons_id[team], None, qpos, q1t, q2, q3))
            # race
            order = sorted(
                entrants, key=lambda e: -(e[0] * 1.0 + rng.gauss(0, 0.035) - grid[e[1]] * 0.002)
            )
            finishers, dnfs = [], []
            for e in order:
                (dnfs if rng.random() < 0.09 else finishers).append(e)
            winner_ms = laps_total * (base_ms + 3500) + rng.randrange(0, 90000)
            fl_candidates = []
            res_for_race = []
            for pos, (pace, did, team, j) in enumerate(finishers, 1):
                gap_ms = int((pos - 1) * rng.uniform(3000, 9000) + (pos - 1) ** 1.6 * 500)
                lapped = 0 if gap_ms < base_ms * 0.9 else min(2, 1 + int(gap_ms > base_ms * 1.8))
                laps = laps_total - lapped
                fl_ms = base_ms + 1000 - int((pace - 0.7) * 3000) + rng.randrange(0, 900)
                fl_candidates.append((fl_ms, did))
                res_for_race.append(
                    [
                        did,
                        team,
                        j,
                        pos,
                        laps,
                        gap_ms if lapped == 0 else None,
                        lapped,
                        fl_ms,
                        1 if lapped == 0 else 10 + lapped,
                    ]
                )
            for _k, (pace, did, team, j) in enumerate(dnfs):
                laps = rng.randrange(0, laps_total - 1)
                fl_ms = (
                    None
                    if laps < 2
                    else base_ms + 1500 - int((pace - 0.7) * 3000) + rng.randrange(0, 1500)
                )
                if fl_ms:
                    fl_candidates.append((fl_ms, did))
                res_for_race.append(
                    [did, team, j, None, laps, None, None, fl_ms, rng.choice(DNF_STATUSES)]
                )
            # positionOrder: finishers first, then DNFs by laps completed
            fin = [r for r in res_for_race if r[3] is not None]
            dnf = sorted((r for r in res_for_race if r[3] is None), key=lambda r: (-r[4], r[0]))
            ranks = {did: k for k, (_, did) in enumerate(sorted(fl_candidates), 1)}
            fastest_did = min(fl_candidates)[1]
            for porder, (did, team, _j, pos, laps, gap_ms, _lapped, fl_ms, st) in enumerate(
                fin + dnf, 1
            ):
                result_id += 1
                pts = float(POINTS[pos - 1]) if pos is not None and pos <= 10 else 0.0
                if year >= 2019 and did == fastest_did and pos is not None and pos <= 10:
                    pts += 1.0
                if pos == 1:
                    time_txt, ms = _fmt_race(winner_ms), winner_ms
                elif pos is not None and gap_ms is not None:
                    time_txt, ms = f"+{gap_ms / 1000:.3f}", winner_ms + gap_ms
                else:
                    time_txt = ms = None
                position_text = (
                    str(pos)
                    if pos is not None
                    else ("D" if st == 2 else ("W" if st == 18 else "R"))
                )
                speed = None if fl_ms is None else f"{CIRCUITS[ci][7] * 3600000 / fl_ms:.3f}"
                number = DRIVERS[did - 1][4]
                result_rows.append(
                    (
                        result_id,
                        race_id,
                        did,
                        cons_id[team],
                        number,
                        grid[did],
                        pos,
                        position_text,
                        porder,
                        pts,
                        laps,
                        time_txt,
                        ms,
                        None
                        if fl_ms is None
                        else rng.randrange(max(1, laps // 2), max(2, laps + 1)),
                        ranks.get(did),
                        None if fl_ms is None else _fmt_lap(fl_ms),
                        speed,
                        st,
                    )
                )
                s = standings.setdefault(did, [0.0, 0])
                s[0] += pts
                s[1] += 1 if pos == 1 else 0
                # pit stops
                if year >= 2015 and laps > 5:
                    for stop in range(1, rng.choice([1, 1, 2, 2, 2, 3]) + 1):
                        lap = min(laps - 1, int(laps * stop / 3.2) + rng.randrange(-3, 4))
                        if lap < 1:
                            continue
                        dur = (
                            rng.randrange(19500, 31000)
                            if rng.random() > 0.03
                            else rng.randrange(35000, 62000)
                        )
                        hh = start_hour + (lap * base_ms) // 3600000
                        mm = ((lap * base_ms) // 60000) % 60
                        pit_rows.append(
                            (
                                race_id,
                                did,
                                stop,
                                lap,
                                f"{hh:02d}:{mm:02d}:{rng.randrange(0, 60):02d}",
                                f"{dur / 1000:.3f}",
                                dur,
                            )
                        )
                # lap times
                if year in LAP_TIME_SEASONS:
                    for lap in range(1, laps + 1):
                        lt = (
                            base_ms
                            + 2500
                            - int((pace_by[did] - 0.7) * 3000)
                            + rng.randrange(0, 2500)
                            + (6000 if lap == 1 else 0)
                        )
                        lap_rows.append([race_id, did, lap, None, lt])
            ordered = sorted(standings.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))
            for spos, (did, (pts, wins)) in enumerate(ordered, 1):
                stand_id += 1
                stand_rows.append((stand_id, race_id, did, pts, spos, str(spos), wins))

    # lap positions: rank cumulative time per (race, lap)
    cum: dict[tuple[int, int], int] = {}
    by_lap: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for row in lap_rows:
        key = (row[0], row[1])
        cum[key] = cum.get(key, 0) + row[4]
        by_lap.setdefault((row[0], row[2]), []).append((cum[key], row[1]))
    pos_of = {}
    for (rid, lap), entries in by_lap.items():
        for p, (_, did) in enumerate(sorted(entries), 1):
            pos_of[(rid, did, lap)] = p

    conn.executemany("INSERT INTO races VALUES (?,?,?,?,?,?,?,?,?,?)", race_rows)
    conn.executemany("INSERT INTO qualifying VALUES (?,?,?,?,?,?,?,?,?)", quali_rows)
    conn.executemany(
        "INSERT INTO results VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", result_rows
    )
    conn.executemany('INSERT INTO "pitStops" VALUES (?,?,?,?,?,?,?)', pit_rows)
    conn.executemany(
        'INSERT INTO "lapTimes" VALUES (?,?,?,?,?,?)',
        ((r[0], r[1], r[2], pos_of[(r[0], r[1], r[2])], _fmt_lap(r[4]), r[4]) for r in lap_rows),
    )
    conn.executemany('INSERT INTO "driverStandings" VALUES (?,?,?,?,?,?,?)', stand_rows)

"""movie_platform: a film-rating community in the style of BIRD's ``movie_platform``.

Tables: ``directors``, ``movies`` (genres as a JSON array in TEXT, metadata as a JSON object in
TEXT), ``users`` (MixedCase and spaced column names, signup timestamps as TEXT, NULL countries),
``ratings`` (REAL scores, TEXT timestamps, optional critic text), ``lists`` and ``list_items``
(ON DELETE CASCADE), a view ``movie_rating_summary`` and triggers keeping ``lists.movie_count``
in step with ``list_items`` and rejecting out-of-range scores.

Everything comes from ``random.Random(SEED)``: the same bytes on every build.
"""

from __future__ import annotations

import datetime
import json
import random
import sqlite3

DB_ID = "movie_platform"
VERSION = 1
SEED = 20240611

N_DIRECTORS = 600
N_MOVIES = 4000
N_USERS = 6000
N_RATINGS = 110_000
N_LISTS = 2500

SCHEMA = [
    """CREATE TABLE directors (
        director_id INTEGER PRIMARY KEY,
        director_name TEXT NOT NULL,
        birth_country TEXT
    )""",
    """CREATE TABLE movies (
        movie_id INTEGER PRIMARY KEY,
        movie_title TEXT NOT NULL,
        release_year INTEGER,
        runtime INTEGER,
        director_id INTEGER REFERENCES directors(director_id),
        title_language TEXT DEFAULT 'en',
        popularity INTEGER NOT NULL DEFAULT 0,
        genres TEXT,
        metadata TEXT
    )""",
    """CREATE TABLE users (
        user_id INTEGER PRIMARY KEY,
        "userName" TEXT NOT NULL UNIQUE,
        "Display Name" TEXT,
        email TEXT,
        country TEXT,
        signup_ts TEXT NOT NULL,
        "isTrialist" INTEGER NOT NULL DEFAULT 0,
        has_payment_method INTEGER NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE ratings (
        rating_id INTEGER PRIMARY KEY,
        movie_id INTEGER NOT NULL REFERENCES movies(movie_id),
        user_id INTEGER NOT NULL REFERENCES users(user_id),
        score REAL NOT NULL,
        rated_at TEXT NOT NULL,
        critic TEXT,
        critic_likes INTEGER NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE lists (
        list_id INTEGER PRIMARY KEY,
        user_id INTEGER NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
        list_title TEXT NOT NULL,
        description TEXT,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL,
        followers INTEGER NOT NULL DEFAULT 0,
        movie_count INTEGER NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE list_items (
        list_id INTEGER NOT NULL REFERENCES lists(list_id) ON DELETE CASCADE,
        movie_id INTEGER NOT NULL REFERENCES movies(movie_id),
        position INTEGER NOT NULL,
        added_at TEXT NOT NULL,
        PRIMARY KEY (list_id, movie_id)
    )""",
]

POST_SCHEMA = [
    "CREATE INDEX idx_movies_director ON movies(director_id)",
    "CREATE INDEX idx_movies_year ON movies(release_year)",
    "CREATE INDEX idx_ratings_movie ON ratings(movie_id)",
    "CREATE INDEX idx_ratings_user ON ratings(user_id)",
    "CREATE INDEX idx_ratings_rated_at ON ratings(rated_at)",
    "CREATE INDEX idx_lists_user ON lists(user_id)",
    "CREATE INDEX idx_list_items_movie ON list_items(movie_id)",
    """CREATE VIEW movie_rating_summary AS
        SELECT m.movie_id, m.movie_title, m.release_year,
               COUNT(r.rating_id) AS n_ratings,
               AVG(r.score) AS avg_score
        FROM movies m LEFT JOIN ratings r ON r.movie_id = m.movie_id
        GROUP BY m.movie_id, m.movie_title, m.release_year""",
    """CREATE TRIGGER trg_list_items_ins AFTER INSERT ON list_items
        BEGIN
            UPDATE lists SET movie_count = movie_count + 1, updated_at = NEW.added_at
            WHERE list_id = NEW.list_id;
        END""",
    """CREATE TRIGGER trg_list_items_del AFTER DELETE ON list_items
        BEGIN
            UPDATE lists SET movie_count = movie_count - 1 WHERE list_id = OLD.list_id;
        END""",
    """CREATE TRIGGER trg_ratings_score_check BEFORE INSERT ON ratings
        WHEN NEW.score < 0.5 OR NEW.score > 5.0
        BEGIN
            SELECT RAISE(ABORT, 'score must be between 0.5 and 5.0');
        END""",
]

_ADJ = [
    "Silent",
    "Broken",
    "Golden",
    "Hidden",
    "Last",
    "Crimson",
    "Endless",
    "Frozen",
    "Wild",
    "Distant",
    "Burning",
    "Quiet",
    "Lost",
    "Electric",
    "Northern",
    "Hollow",
    "Midnight",
    "Paper",
    "Velvet",
    "Iron",
    "Secret",
    "Bitter",
    "Little",
    "Savage",
    "Lonely",
]
_NOUN = [
    "Harbor",
    "River",
    "Summer",
    "City",
    "Garden",
    "Mirror",
    "Train",
    "Kingdom",
    "Shadow",
    "Highway",
    "Island",
    "Letter",
    "Orchard",
    "Winter",
    "Station",
    "Theory",
    "Machine",
    "Dream",
    "Frontier",
    "Parade",
    "Lighthouse",
    "Carnival",
    "Witness",
    "Storm",
    "Echo",
]
_PATTERNS = [
    "The {a} {n}",
    "{a} {n}",
    "A {a} {n}",
    "The {n}",
    "{n} of the {a} {n2}",
    "Return to the {n}",
    "{a} {n} II",
    "Beyond the {n}",
    "{n} & {n2}",
    "Mr. {n}",
]
_GENRES = [
    "Drama",
    "Comedy",
    "Thriller",
    "Horror",
    "Documentary",
    "Romance",
    "Sci-Fi",
    "Animation",
    "Crime",
    "Adventure",
    "Fantasy",
    "Musical",
    "War",
    "Western",
    "Mystery",
]
_LANGS = ["en"] * 14 + ["fr", "fr", "es", "de", "it", "ja", "ko", "sv", "pt", "zh"]
_COUNTRIES = [
    "USA",
    "France",
    "Germany",
    "UK",
    "Japan",
    "Brazil",
    "Canada",
    "Spain",
    "Italy",
    "South Korea",
    "Mexico",
    "India",
    "Sweden",
    "Australia",
    "Poland",
]
_FIRST = [
    "Anna",
    "Ben",
    "Clara",
    "David",
    "Elena",
    "Felix",
    "Grace",
    "Hugo",
    "Ines",
    "Jonas",
    "Karin",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Pablo",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
    "Umar",
    "Vera",
    "Wen",
    "Ximena",
    "Yusuf",
    "Zoe",
    "Marta",
    "Akira",
    "Lucia",
    "Omar",
]
_LAST = [
    "Adams",
    "Berg",
    "Costa",
    "Dubois",
    "Eriksson",
    "Fischer",
    "Garcia",
    "Hansen",
    "Ito",
    "Jensen",
    "Kowalski",
    "Lopez",
    "Moreau",
    "Nakamura",
    "Olsen",
    "Petrov",
    "Rossi",
    "Schmidt",
    "Tanaka",
    "Usman",
    "Varga",
    "Weber",
    "Young",
    "Zhang",
    "Novak",
    "Kim",
]
_KEYWORDS = [
    "heist",
    "coming-of-age",
    "revenge",
    "road trip",
    "time travel",
    "small town",
    "based on novel",
    "true story",
    "dystopia",
    "family",
    "friendship",
    "space",
    "courtroom",
    "sports",
    "music",
    "war",
    "ghost",
    "detective",
    "island",
    "wedding",
]
_CRITIC = [
    "Loved every minute.",
    "A bit too long in the middle.",
    "The score is wonderful.",
    "Overrated, honestly.",
    "Beautiful cinematography!",
    "Fell asleep twice.",
    "An instant classic.",
    "The ending ruined it for me.",
    "Great cast, weak script.",
    "Rewatched it, still amazing.",
    "Not my kind of film.",
    "Masterpiece.",
]
_LIST_WORDS = [
    "Favorites",
    "Watchlist",
    "Best of",
    "Comfort films",
    "Rainy day",
    "Must see",
    "Hidden gems",
    "Guilty pleasures",
    "Top 10",
    "To rewatch",
    "Date night",
    "Criterion picks",
    "Festival favorites",
    "Halloween",
    "Sunday classics",
]


def _ts(rng: random.Random, y0: int, y1: int) -> str:
    """A 'YYYY-MM-DD HH:MM:SS' timestamp uniformly within the years y0..y1."""
    day = datetime.date.fromordinal(
        rng.randint(datetime.date(y0, 1, 1).toordinal(), datetime.date(y1, 12, 31).toordinal())
    )
    sec = rng.randrange(86_400)
    return f"{day.isoformat()} {sec // 3600:02d}:{sec // 60 % 60:02d}:{sec % 60:02d}"


def _directors(rng: random.Random):
    for i in range(1, N_DIRECTORS + 1):
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        country = None if rng.random() < 0.1 else rng.choice(_COUNTRIES)
        yield i, name, country


def _title(rng: random.Random) -> str:
    p = rng.choice(_PATTERNS)
    return p.format(a=rng.choice(_ADJ), n=rng.choice(_NOUN), n2=rng.choice(_NOUN))


def _movies(rng: random.Random):
    for i in range(1, N_MOVIES + 1):
        title = _title(rng)
        r = rng.random()
        if r < 0.02:
            title = title + " "  # stray trailing space from a bad import
        elif r < 0.04:
            title = title.upper()
        year = None if rng.random() < 0.015 else rng.randint(1950, 2023)
        runtime = None if rng.random() < 0.05 else rng.randint(70, 190)
        director = rng.randint(1, N_DIRECTORS)
        lang = rng.choice(_LANGS)
        popularity = int(rng.paretovariate(1.3) * 10) - 10
        genres = rng.sample(_GENRES, rng.choice([1, 1, 2, 2, 2, 3]))
        genres_txt = None if rng.random() < 0.01 else json.dumps(genres)
        meta: dict = {"budget_usd": rng.randrange(100_000, 200_000_000, 50_000)}
        if rng.random() < 0.15:
            del meta["budget_usd"]
        if rng.random() < 0.6:
            meta["awards"] = {"wins": rng.randint(0, 12), "nominations": rng.randint(0, 30)}
        meta["keywords"] = rng.sample(_KEYWORDS, rng.randint(0, 4))
        if rng.random() < 0.3:
            meta["mpaa"] = rng.choice(["G", "PG", "PG-13", "R", "NC-17"])
        yield i, title, year, runtime, director, lang, popularity, genres_txt, json.dumps(meta)


def _users(rng: random.Random):
    for i in range(1, N_USERS + 1):
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        uname = f"{first.lower()}{last.lower()}{i}"
        display = None if rng.random() < 0.2 else f"{first} {last}"
        email = (
            None
            if rng.random() < 0.07
            else f"{uname}@{rng.choice(['mail.com', 'inbox.org', 'Example.NET', 'cine.io'])}"
        )
        country = None if rng.random() < 0.15 else rng.choice(_COUNTRIES)
        signup = _ts(rng, 2012, 2023)
        trialist = 1 if rng.random() < 0.25 else 0
        payment = 1 if rng.random() < 0.55 else 0
        yield i, uname, display, email, country, signup, trialist, payment


def _ratings(rng: random.Random, movie_weights: list[float]):
    movie_ids = list(range(1, N_MOVIES + 1))
    movies = rng.choices(movie_ids, weights=movie_weights, k=N_RATINGS)
    for i in range(1, N_RATINGS + 1):
        user = rng.randint(1, N_USERS)
        score = rng.choice([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.0, 3.5, 3.5, 4.0, 4.0, 4.0, 4.5, 5.0])
        rated_at = _ts(rng, 2013, 2023)
        critic = rng.choice(_CRITIC) if rng.random() < 0.08 else None
        likes = rng.randint(0, 60) if critic else 0
        yield i, movies[i - 1], user, score, rated_at, critic, likes


def _lists(rng: random.Random):
    for i in range(1, N_LISTS + 1):
        user = rng.randint(1, N_USERS)
        title = f"{rng.choice(_LIST_WORDS)} {rng.choice(['', '2019', '2020', '2021', '2022', 'ever', 'vol. 2'])}".strip()
        desc = None if rng.random() < 0.5 else f"Curated by user {user}"
        created = _ts(rng, 2014, 2022)
        followers = int(rng.paretovariate(1.5) * 3) - 3
        yield i, user, title, desc, created, created, followers, 0


def _list_items(rng: random.Random, list_created: list[str]):
    for list_id in range(1, N_LISTS + 1):
        n = rng.choice([0, 1, 3, 5, 8, 10, 12, 15, 20, 25])
        movies = rng.sample(range(1, N_MOVIES + 1), n)
        created = list_created[list_id - 1]
        y = int(created[:4])
        for pos, movie in enumerate(movies, 1):
            added = _ts(rng, y, min(y + 1, 2023))
            if added < created:
                added = created
            yield list_id, movie, pos, added


def build(conn: sqlite3.Connection) -> None:
    """Fill an empty database (inside the caller's transaction)."""
    rng = random.Random(SEED)
    for stmt in SCHEMA:
        conn.execute(stmt)
    conn.executemany("INSERT INTO directors VALUES (?,?,?)", _directors(rng))
    conn.executemany("INSERT INTO movies VALUES (?,?,?,?,?,?,?,?,?)", _movies(rng))
    conn.executemany("INSERT INTO users VALUES (?,?,?,?,?,?,?,?)", _users(rng))
    weights = [min(rng.paretovariate(1.2), 40.0) for _ in range(N_MOVIES)]
    conn.executemany("INSERT INTO ratings VALUES (?,?,?,?,?,?,?)", _ratings(rng, weights))
    lists = list(_lists(rng))
    conn.executemany("INSERT INTO lists VALUES (?,?,?,?,?,?,?,?)", lists)
    conn.executemany(
        "INSERT INTO list_items VALUES (?,?,?,?)", _list_items(rng, [row[4] for row in lists])
    )
    # Bring the denormalised counters in step before the triggers take over.
    conn.execute("""UPDATE lists SET
        movie_count = (SELECT COUNT(*) FROM list_items li WHERE li.list_id = lists.list_id),
        updated_at = COALESCE((SELECT MAX(added_at) FROM list_items li
                               WHERE li.list_id = lists.list_id), created_at)""")
    for stmt in POST_SCHEMA:
        conn.execute(stmt)

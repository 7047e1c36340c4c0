"""Deterministic builders of the bundled databases, one module per database.

Each module exposes ``DB_ID`` (the database name), ``VERSION`` (bump to rebuild caches) and
``build(conn)``, which fills an empty SQLite database through an open transaction using only
seeded randomness, so every machine builds the same data.
"""

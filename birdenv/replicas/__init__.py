"""Trajectory-scoped persistent execution: immutable bases, copy-on-write sessions, a pool."""

from birdenv.replicas.pool import ReplicaPool
from birdenv.replicas.session import Limits, Result, Session
from birdenv.replicas.store import Base, BaseStore

__all__ = ["Base", "BaseStore", "Limits", "ReplicaPool", "Result", "Session"]

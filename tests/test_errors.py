"""Every error the project defines is under its one root, so `except BirdEnvError` catches them."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import birdenv
import birdtrain
from birdenv.errors import BirdEnvError


def _project_modules() -> list[str]:
    names = []
    for package in (birdenv, birdtrain):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            names.append(info.name)
    return names


# Imports every module of both packages (~14 s of CPU, the training stack included).
@pytest.mark.slow
def test_every_error_class_of_the_project_derives_from_the_root() -> None:
    outside, skipped = [], []
    for name in _project_modules():
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # an optional extra that is not installed here
            skipped.append(f"{name}: {exc}")
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            # A private exception is control flow inside its module, never raised out of it.
            public = cls.__module__ == name and not cls.__name__.startswith("_")
            if public and issubclass(cls, Exception) and not issubclass(cls, BirdEnvError):
                outside.append(f"{name}.{cls.__name__}")
    assert outside == [], f"errors outside BirdEnvError: {outside}"
    assert len(skipped) < 5, skipped  # the check saw (nearly) every module

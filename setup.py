"""Build hook for the optional C extensions: the page-overlay VFS, a result's size and the step's
speedups.

The extension links the system ``libsqlite3`` so that, where Python's ``_sqlite3`` links the same
shared library, the VFS registers into the very library stdlib connections use. The build is
optional: without a compiler or SQLite headers the package still installs and the replica pool
falls back to the ``copy`` strategy (see ``birdenv doctor``). ``birdenv._speedups`` parses each
step's tool call and formats its result table, and ``birdenv.replicas.native._sizes`` counts a fetched
batch's bytes; without them the same rules run in Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "birdenv.replicas.native._overlay",
            sources=["birdenv/replicas/native/overlay.c"],
            # overlay.c includes its parts: one translation unit (see overlay.h)
            depends=[
                "birdenv/replicas/native/overlay.h",
                "birdenv/replicas/native/overlay_file.c",
                "birdenv/replicas/native/overlay_pages.c",
                "birdenv/replicas/native/overlay_vfs.c",
                "birdenv/replicas/native/overlay_selftest.c",
            ],
            libraries=["sqlite3"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        ),
        Extension(
            "birdenv.replicas.native._sizes",
            sources=["birdenv/replicas/native/sizes.c"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        ),
        Extension(
            "birdenv._speedups",
            sources=["birdenv/_speedups.c"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        ),
    ]
)

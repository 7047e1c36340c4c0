"""What makes a run directory trustworthy: one writer, an honest record, verified files, and
interrupts that say what they kept.

- **One writer.** :func:`hold` takes the directory's OS lock (:func:`birdenv.files.directory_lock`)
  for a command's whole life; a second writer fails at once naming the holder.
- **An honest record.** :func:`settings_differ` is the one rule by which a resumed piece of work
  (a stage, an evaluation) refuses other settings than those it was begun with, naming each
  changed key with both values. :data:`NO_EFFECT` lists the keys that cannot change a result.
  :func:`first_changed` says which stage a changed key touches first.
- **Verified files.** :func:`commit_folder` renames a finished folder into place with a
  ``MANIFEST.json`` of its files' sizes and SHA-256; :func:`verify_folder` checks it (sizes
  always, hashes the first time in a process) and names a damaged or missing file and its fix.
- **Interrupts.** SIGTERM unwinds like Ctrl-C (:mod:`birdenv.interrupts`); :func:`working_on`
  names what is being done for :func:`interrupted_message`, and reports an error that follows an
  interrupt (a worker that died of the same signal) as the interrupt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from birdenv.files import describe_holder, directory_lock, file_sha256
from birdenv.interrupts import interrupt_behind, signal_name
from birdtrain.errors import DamagedFileError

__all__ = [
    "MANIFEST",
    "NO_EFFECT",
    "command_line",
    "commit_folder",
    "completed_work",
    "first_changed",
    "flatten",
    "folder_hash",
    "hold",
    "interrupted_message",
    "settings_differ",
    "verify_folder",
    "working_on",
    "write_manifest",
    "write_once",
]

#: The file in a committed folder that lists its other files' sizes and SHA-256.
MANIFEST = "MANIFEST.json"

#: Configuration keys that cannot change what a stage or an evaluation produces: where the run is
#: written, how processes are arranged, which evaluations run, how many episodes run at once, the
#: intermediate checkpoints kept, the name of the variable holding the teacher's key.
NO_EFFECT = frozenset(
    {
        "name",
        "output_dir",
        "report_to",
        "isolate",
        "eval.enabled",
        "eval.before",
        "eval.after",
        "eval.num_envs",
        "eval.gpu_memory_utilization",
        "data.teacher_api_key_env",
        "stage1.save_steps",
        "stage2.save_steps",
        "stage3.save_steps",
        "stage4.save_steps",
    }
)


# --- one writer ---------------------------------------------------------------------------------


def command_line() -> str:
    """This process's command as a user typed it (``birdtrain curriculum --preset smoke``)."""
    program = Path(sys.argv[0]).name
    if program in ("cli.py", "__main__.py"):  # python -m birdtrain.cli
        program = "birdtrain"
    return " ".join([program, *sys.argv[1:]])


@contextlib.contextmanager
def hold(directory: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold ``directory`` as its one writer for the ``with`` block (see
    :func:`birdenv.files.directory_lock`); say so when a dead holder's lock is taken over."""
    with directory_lock(directory, command_line()) as lock:
        if lock.took_over:
            print(
                f"[lock] {lock.directory}: taking over from {describe_holder(lock.took_over)}, "
                "which ended without letting go; its finished work is kept, the rest is redone"
            )
        yield lock.directory


# --- an honest record ---------------------------------------------------------------------------


def flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"stage3": {"beta": 0.1}}`` → ``{"stage3.beta": 0.1}`` (lists and scalars are leaves)."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def settings_differ(
    recorded: dict[str, Any], current: dict[str, Any], *, ignore: frozenset[str] = frozenset()
) -> list[str]:
    """Each key whose value differs, as ``"key: <recorded> there, <current> here"``, sorted.

    Nested settings are compared key by key (dotted names). A key the record lacks was added after
    it was written and is not compared; keys in ``ignore`` cannot change a result. Values are
    compared as JSON would store them (a tuple equals a list).
    """
    old = flatten(json.loads(json.dumps(recorded, default=str)))
    new = flatten(json.loads(json.dumps(current, default=str)))
    return [
        f"{key}: {old[key]!r} there, {new.get(key)!r} here"
        for key in sorted(old)
        if key not in ignore and key in new and old[key] != new[key]
    ]


def first_changed(differ: list[str], stages: tuple[str, ...]) -> str:
    """The first part of the run a list of :func:`settings_differ` lines touches: a stage's own
    keys touch that stage; ``eval.*`` touches only the evaluations (``"eval"``); every other key
    (seed, model, prompt, data) touches the first stage."""
    touched = set()
    for line in differ:
        section = line.split(".", 1)[0].split(":", 1)[0]
        touched.add(section if section in stages or section == "eval" else stages[0])
    for stage in stages:
        if stage in touched:
            return stage
    return "eval"


def write_once(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` as JSON at ``path`` whole (renamed into place), unless ``path`` exists:
    a record, once written, is never overwritten."""
    if path.exists():
        return
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(record, indent=2, default=str))
    os.replace(staging, path)


# --- verified files -----------------------------------------------------------------------------

#: Folders whose files' hashes this process has checked: (real path, manifest's mtime).
_HASHED: set[tuple[str, int]] = set()


def _manifest_of(folder: Path) -> dict[str, dict[str, Any]]:
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not p.name.startswith((MANIFEST, ".")) and p.suffix != ".tmp"
    )
    return {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in files
    }


def write_manifest(folder: Path) -> None:
    """Record ``folder``'s files' sizes and SHA-256 in its ``MANIFEST.json`` (for files written
    atomically one by one, like the trajectory store's parts)."""
    manifest = _manifest_of(folder)
    staging = folder / f".{MANIFEST}.tmp"
    staging.write_text(json.dumps({"files": manifest}, indent=2, sort_keys=True))
    os.replace(staging, folder / MANIFEST)


def commit_folder(staging: Path, final: Path) -> Path:
    """Write ``staging``'s manifest into it and rename it to ``final`` (replacing what an
    interrupted earlier attempt left there): ``final`` is whole or absent, never half written."""
    write_manifest(staging)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    with contextlib.suppress(OSError):  # the rename reaches the disk before a record names it
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _HASHED.add((str(final.resolve()), (final / MANIFEST).stat().st_mtime_ns))
    return final


def folder_hash(folder: Path) -> str:
    """The content hash of a committed folder: the SHA-256 of its manifest."""
    return hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest()


def verify_folder(folder: Path, *, fix: str, hashes: bool = True) -> None:
    """Check a committed folder against its manifest: every file there with its size, and, with
    ``hashes`` and the first time this process checks it, its SHA-256. A folder without a
    manifest (written before manifests existed) is not checked.

    Raises :class:`~birdtrain.errors.DamagedFileError` naming the first missing or damaged file and
    ``fix``, what makes it again.
    """
    manifest_path = folder / MANIFEST
    if not folder.is_dir():
        raise DamagedFileError(f"{folder} is missing; {fix}")
    if not manifest_path.is_file():
        return
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        raise DamagedFileError(f"{manifest_path} is damaged; {fix}") from None
    key = (str(folder.resolve()), manifest_path.stat().st_mtime_ns)
    hashed = key in _HASHED or not hashes
    for name, expected in files.items():
        path = folder / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise DamagedFileError(f"{path} is missing; {fix}") from None
        if size != expected["size"]:
            raise DamagedFileError(
                f"{path} is damaged ({size} bytes, {expected['size']} when written); {fix}"
            )
        if not hashed and file_sha256(path) != expected["sha256"]:
            raise DamagedFileError(f"{path} is damaged (its content changed); {fix}")
    if hashes:
        _HASHED.add(key)


# --- interrupts ---------------------------------------------------------------------------------


@contextlib.contextmanager
def working_on(directory: Path, what: str) -> Iterator[None]:
    """Name the work under way in the run or output ``directory`` (``"stage3"``, ``"the
    evaluation after_stage2"``): an interrupt raised inside carries it to
    :func:`interrupted_message` (the innermost name wins). An error that follows an interrupt
    (:func:`interrupt_behind`) is raised as that interrupt, from the error."""
    try:
        yield
    except BaseException as exc:
        interrupt = interrupt_behind(exc)
        if interrupt is None:
            raise
        if not hasattr(interrupt, "during"):
            interrupt.during = (Path(directory), what)  # type: ignore[attr-defined]
        if interrupt is exc:
            raise
        raise interrupt from exc


def interrupted_message(exc: KeyboardInterrupt) -> str:
    """One line for a command ended by SIGINT or SIGTERM: the work it interrupted, what the
    directory keeps, and that the same command resumes."""
    name = signal_name(exc)
    during = getattr(exc, "during", None)
    if during is None:
        return f"interrupted by {name}"
    directory, what = during
    return (
        f"interrupted by {name} during {what}; {directory} keeps {completed_work(directory)}; "
        "run the same command to resume"
    )


def completed_work(directory: Path) -> str:
    """What a run or evaluation directory holds finished, in words: its complete stages and
    evaluations, or the episodes an interrupted evaluation saved."""
    directory = Path(directory)
    done = sorted(p.parent.name for p in directory.glob("stage*/DONE"))
    evals = sorted(p.parent.name for p in directory.glob("eval/*/summary.json"))
    parts = []
    if done:
        parts.append("its complete stages (" + ", ".join(done) + ")")
    if evals:
        parts.append("its complete evaluations (" + ", ".join(evals) + ")")
    progress = directory / "episodes.partial.jsonl"
    if progress.is_file():
        episodes = max(0, len(progress.read_text().splitlines()) - 1)
        parts.append(f"the {episodes} episodes it finished")
    return " and ".join(parts) or "nothing finished"

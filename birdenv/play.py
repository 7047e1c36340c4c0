"""``birdenv play``: be the agent yourself, in a terminal.

A person takes the model's seat in :class:`~birdenv.envs.critic.BirdCriticEnv` (or
``BirdCritic-PostgreSQL-v0`` for PostgreSQL tasks, ``suite="critic-mini-pg"``): the same prompt,
the same session (writes and TEMP tables persist across turns), the same observation formatter and
the same judge. Every statement typed is wrapped with
:func:`~birdenv.tools.format_tool_call` and sent through ``env.step``, so the terminal shows
exactly the text a model would read.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
from pathlib import Path
from typing import TextIO

import gymnasium as gym

from birdenv.envs import env_class_for
from birdenv.schema import task_schema
from birdenv.tasks import Task, load_tasks
from birdenv.tools import format_tool_call

__all__ = ["HELP", "play"]

HELP = """commands:
  SQL ...;       run one statement on your copy of the database; it ends at a line ending
                 with ';' (a trigger body runs to its END;) or at a blank line
  \\submit        submit your fix: type the statements, each ending with ';', then a blank line
                 (\\cancel on its own line goes back without submitting); this ends the task
  \\schema        the schema part of the prompt again (the database as the task starts)
  \\help          this text
  \\quit          leave without submitting"""

_PROMPT = "sql> "
_MORE = "  -> "
_SUBMIT = "submit> "


class _Terminal:
    """Line input and output over two streams; line editing when they are the real terminal."""

    def __init__(self, stdin: TextIO, stdout: TextIO) -> None:
        self.stdin, self.stdout = stdin, stdout
        self.interactive = stdin is sys.stdin and stdout is sys.stdout and stdin.isatty()
        if self.interactive:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401 - gives input() history and editing

    def write(self, text: str) -> None:
        self.stdout.write(text + "\n")
        self.stdout.flush()

    def read(self, prompt: str) -> str | None:
        """One line without its newline, or ``None`` at end of input."""
        if self.interactive:
            try:
                return input(prompt)
            except EOFError:
                self.stdout.write("\n")
                return None
        line = self.stdin.readline()
        if not line:
            return None
        line = line.rstrip("\n").rstrip("\r")
        # Piped input: echo it after the prompt so the transcript reads like a session.
        self.write(prompt + line)
        return line


def _read_statement(term: _Terminal, first: str) -> str:
    """Lines from ``first`` on, up to one ending with ``;`` that completes the statement, or a blank."""
    lines = [first]
    while not (first.rstrip().endswith(";") and sqlite3.complete_statement("\n".join(lines))):
        line = term.read(_MORE)
        if line is None or not line.strip():
            break
        lines.append(line)
        first = line
    return "\n".join(lines).strip()


def _read_submission(term: _Terminal, first: str) -> list[str] | None:
    """Statements up to a blank line (``None`` on ``\\cancel``); each ends at a complete ``;``."""
    statements: list[str] = []
    lines: list[str] = [first] if first.strip() else []
    while True:
        if (
            lines
            and lines[-1].rstrip().endswith(";")
            and sqlite3.complete_statement("\n".join(lines))
        ):
            statements.append("\n".join(lines).strip())
            lines = []
        line = term.read(_SUBMIT)
        if line is None or not line.strip():
            break
        if line.strip() == "\\cancel":
            return None
        lines.append(line)
    if lines:
        statements.append("\n".join(lines).strip())
    # Submitted the way task files write SQL: no trailing semicolon.
    return [s[:-1].rstrip() if s.endswith(";") else s for s in statements if s.strip(" ;\n")]


def play(
    task_id: str | None,
    *,
    suite: str = "critic-mini",
    tasks: str | Path | list[Task] | None = None,
    db_dir: str | Path | None = None,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
) -> int:
    """Play one task as the agent in a terminal; return an exit status.

    Args:
        task_id: The task to play; ``None`` draws one at random.
        suite: A bundled suite; ignored when ``tasks`` is given.
        tasks: A task JSONL file in the official format (or a list of tasks), with ``db_dir``.
        db_dir: The folder holding ``{db_id}/{db_id}_template.sqlite`` for ``tasks``.
        stdin: Where the person's lines come from.
        stdout: Where the prompt, the observations and the verdict go.

    Returns:
        0 when the submission passes or the person quits without submitting, 1 when the
        submission fails, 2 when ``task_id`` is not in the task set.
    """
    term = _Terminal(stdin, stdout)
    if not isinstance(tasks, list):
        tasks = load_tasks(tasks if tasks is not None else suite, db_dir=db_dir)
    # The environment of the tasks' dialect (BirdCritic-PostgreSQL-v0 for PostgreSQL tasks).
    if not tasks:
        raise ValueError("the task set is empty")
    env = env_class_for(tasks[0])(tasks=tasks)
    try:
        if task_id is not None and task_id not in {t.instance_id for t in env.tasks}:
            known = ", ".join(t.instance_id for t in env.tasks[:5])
            term.write(
                f"unknown task {task_id!r}; this task set has {len(env.tasks)}: {known}, ..."
            )
            return 2
        prompt, info = env.reset(options={"task_id": task_id} if task_id is not None else None)
        turns = gym.spec(env.env_id).max_episode_steps
        term.write(f"=== task {info['task_id']} ({info['category']}, database {info['db_id']}) ===")
        term.write(prompt)
        term.write(
            "\n=== you are the agent: type SQL to explore, \\submit to answer, \\help for more ==="
        )
        turn = 0
        while True:
            line = term.read(_PROMPT)
            if line is None:
                term.write("end of input; nothing submitted")
                return 0
            command, _, rest = line.strip().partition(" ")
            if not command:
                continue
            if not command.startswith("\\"):
                turn += 1
                statement = _read_statement(term, line)
                observation, *_ = env.step(format_tool_call("execute_sql", sql=statement))
                # A model has a limit of turns (the TimeLimit of the registered env); here it
                # is only shown, so a person can explore freely.
                term.write(f"[turn {turn}/{turns}]\n{observation}")
            elif command in ("\\q", "\\quit", "\\exit"):
                term.write("nothing submitted")
                return 0
            elif command in ("\\h", "\\help", "\\?"):
                term.write(HELP)
            elif command == "\\schema":
                term.write(task_schema(env.task, catalog=env.server_catalog(env.task)))
            elif command == "\\submit":
                term.write("type the statements to submit, each ending with ';'; a blank line ends")
                statements = _read_submission(term, rest)
                if not statements:
                    term.write("nothing submitted; carry on exploring")
                    continue
                observation, _, _, _, info = env.step(
                    format_tool_call("submit_solution", sql_list=statements)
                )
                term.write(observation)
                return 0 if info["verdict"]["status"] == "success" else 1
            else:
                term.write(f"unknown command {command}; \\help lists the commands")
    finally:
        env.close()

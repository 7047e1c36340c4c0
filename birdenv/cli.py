"""The ``birdenv`` command: bundled data, official-style evaluation, a terminal agent, diagnostics.

birdenv data list | build [--force] | validate [--suite NAME | --tasks T --db-dir D]
birdenv evaluate PRED [--suite S | --tasks T --db-dir D] [--scorer auto|critic|ex] [--out OUT] [--jobs N] [--ray]
birdenv doctor
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sqlite3
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from birdenv import suites
from birdenv.agents import AGENTS, play_tasks
from birdenv.errors import BirdEnvError
from birdenv.files import directory_lock
from birdenv.interrupts import (
    interrupted_status,
    interrupts_raised,
    reporting_interrupts,
    signal_name,
)
from birdenv.judge import INSTANCE_TIMEOUT, validate_tasks
from birdenv.judge.ex import validate_bird
from birdenv.predictions import choose_kind, evaluate_file, write_jsonl
from birdenv.replicas import descriptors, overlay
from birdenv.replicas.placement import default_root, default_sessions_dir, is_memory_filesystem
from birdenv.replicas.pool import MEMORY_HEADROOM
from birdenv.tasks import BIRD_SUITES, CATEGORIES, Task, load_bird, load_tasks
from birdenv.tools import SPEEDUPS_MISSING

__all__ = ["main", "subcommand"]

# The commands that play (play, demo) import the environments when they run, not here: gymnasium
# and numpy cost 0.65 s of CPU against this module's 0.19 s (measured), which `birdenv evaluate`,
# `data` and `doctor` would pay for nothing; `serve` and PostgreSQL's report need optional extras.


def _progress(items: Iterable[Any], total: int, label: str) -> Iterator[Any]:
    """Yield ``items`` while drawing a one-line progress bar on standard error when it is a
    terminal (nothing otherwise)."""
    # sys.stderr as it is now, not as it was when this module loaded (a caller may replace it).
    stream = sys.stderr
    draw = stream.isatty() and total >= 20
    start = time.monotonic()
    for done, item in enumerate(items, 1):
        yield item
        if draw:
            width = 30
            filled = width * done // total
            rate = done / max(time.monotonic() - start, 1e-9)
            stream.write(
                f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {rate:.1f}/s"
            )
            stream.flush()
    if draw:
        stream.write("\n")


def _success_table(
    rows: list[dict[str, Any]],
    *,
    key: str = "category",
    order: tuple[str, ...] = CATEGORIES,
    metric: str = "SR %",
) -> str:
    """The share of successes overall and per ``key`` (Success Rate per category by default;
    execution accuracy per difficulty for BIRD), as the official reports count it."""
    by_category: dict[str, list[bool]] = defaultdict(list)
    for row in rows:
        by_category[row.get(key) or "unknown"].append(row["status"] == "success")
    ordered = [c for c in order if c in by_category] + sorted(set(by_category) - set(order))
    lines = [f"{key:<16}{'n':>6}{'success':>9}{metric:>8}"]
    for category in ordered:
        results = by_category[category]
        lines.append(
            f"{category:<16}{len(results):>6}{sum(results):>9}{100 * sum(results) / len(results):>8.2f}"
        )
    total = sum(len(r) for r in by_category.values())
    wins = sum(sum(r) for r in by_category.values())
    lines.append(f"{'overall':<16}{total:>6}{wins:>9}{(100 * wins / total if total else 0):>8.2f}")
    return "\n".join(lines)


# -- birdenv data ------------------------------------------------------------------------------
def _cmd_data_list(args: argparse.Namespace) -> int:
    suite = suites.ensure()
    for name, purpose in suites.SUITES.items():
        tasks = load_tasks(name)
        counts = Counter(t.category for t in tasks)
        cats = ", ".join(f"{c} {counts[c]}" for c in CATEGORIES if counts[c])
        print(f"{name:<12} {len(tasks):>4} tasks ({cats}) - {purpose}")
    print(f"\ndatabases in {suite.db_dir}:")
    for db_id in suites.database_modules():
        path = suite.db_dir / db_id / f"{db_id}_template.sqlite"
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
            tables = conn.execute(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table'"
            ).fetchone()[0]
        conn.close()
        print(f"  {db_id:<20} {path.stat().st_size / 1e6:>8.1f} MB  {tables:>3} tables")
    return 0


def _cmd_data_build(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    suite = suites.ensure(verify=True, force=args.force)
    print(
        f"built and verified the bundled suites in {time.perf_counter() - start:.1f} s: {suite.db_dir.parent}"
    )
    return 0


def _select_tasks(args: argparse.Namespace) -> list[Task]:
    if args.tasks:
        return load_tasks(args.tasks, db_dir=args.db_dir)
    return load_tasks(args.suite or "critic-mini")


def _cmd_data_validate(args: argparse.Namespace) -> int:
    if args.bird:
        questions = load_bird(args.bird, db_dir=args.db_dir)
        problems = validate_bird(questions, max_seconds=1.0)
        for line in problems:
            print(line)
        print(
            f"{len(questions) - len(problems)}/{len(questions)} questions valid (gold runs, non-empty, < 1 s of CPU)"
        )
        return 1 if problems else 0

    tasks = _select_tasks(args)
    problems = validate_tasks(
        tasks, processes=args.jobs, progress=lambda v: _progress(v, len(tasks), "validating")
    )
    for line in problems:
        print(line)
    print(f"{len(tasks) - len(problems)}/{len(tasks)} tasks valid (gold passes, issue SQL fails)")
    return 1 if problems else 0


# -- birdenv evaluate --------------------------------------------------------------------------
def _cmd_evaluate(args: argparse.Namespace) -> int:

    path = Path(args.predictions)
    if not path.is_file():
        print(f"birdenv evaluate: no such file: {path}", file=sys.stderr)
        return 2
    kind, reason = choose_kind(path, scorer=args.scorer, suite=args.suite, tasks=args.tasks)
    print(f"scoring {kind.metric_name.replace('_', ' ')} ({reason})", file=sys.stderr)
    out = Path(args.out) if args.out else path.with_name(path.stem + ".verdicts.jsonl")
    # One writer of the verdicts' folder at a time: a second fails at once, naming the first.
    with directory_lock(out.parent, " ".join(["birdenv", *sys.argv[1:]])):
        result = evaluate_file(
            path,
            kind,
            suite=args.suite,
            tasks=args.tasks,
            db_dir=args.db_dir,
            jobs=args.jobs,
            statement_timeout=args.statement_timeout,
            instance_timeout=args.instance_timeout,
            cache=args.cache,
            ray=args.ray,
            progress=_progress,
        )
        for warning in result.warnings:
            print(warning, file=sys.stderr)
        write_jsonl(result.rows, out)
    metric = f"{kind.metric} %"
    print(
        _success_table(result.counted, key=kind.category_name, order=kind.categories, metric=metric)
    )
    print(
        f"judged {result.judged} predictions ({result.source}) in {result.seconds:.1f} s; "
        f"verdicts written to {out}"
    )
    return 0


# -- birdenv demo ------------------------------------------------------------------------------
def _cmd_demo(args: argparse.Namespace) -> int:
    """Build the data, run reference agents through the environment, evaluate what they submitted."""
    # gymnasium takes ~0.8 s of CPU to import: loaded for this command only
    import gymnasium as gym

    start = time.perf_counter()
    suites.ensure(args.suite)
    tasks = load_tasks(args.suite)[: args.limit or None]
    print(f"{args.suite}: {len(tasks)} tasks, data ready in {time.perf_counter() - start:.1f} s")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # the environments bring gymnasium (~0.8 s of CPU): loaded for this command only
    from birdenv.envs import env_id_for

    env = gym.make(env_id_for(tasks[0]), suite=args.suite)  # a PostgreSQL suite on PostgreSQL
    for name, agent_cls in AGENTS.items():
        agent = agent_cls()
        started = time.perf_counter()
        rows, rewards = play_tasks(
            env,
            agent,
            tasks,
            progress=functools.partial(_progress, total=len(tasks), label=f"{name} agent"),
        )
        predictions = write_jsonl(rows, out_dir / f"{name}.predictions.jsonl")
        elapsed = time.perf_counter() - started
        print(
            f"\n{name} agent: mean reward {sum(rewards) / len(rewards):.3f} over {len(rewards)} episodes in {elapsed:.1f} s"
        )
        print(f"evaluating {predictions} with `birdenv evaluate`:")
        code = main(["evaluate", str(predictions), "--suite", args.suite, "--jobs", str(args.jobs)])
        if code:
            return code
    env.close()
    return 0


# -- birdenv play ------------------------------------------------------------------------------
def _cmd_play(args: argparse.Namespace) -> int:
    # the environments bring gymnasium (~0.8 s of CPU): loaded for this command only
    from birdenv.play import play

    if args.tasks:
        return play(args.task_id, tasks=args.tasks, db_dir=args.db_dir)
    return play(args.task_id, suite=args.suite)


# -- birdenv serve -----------------------------------------------------------------------------
def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        # the openenv extra: imported only where used
        from birdenv.integrations.openenv import serve
    except ImportError as exc:
        print(
            f"birdenv serve needs openenv-core: pip install 'bird-rl[openenv]' ({exc})",
            file=sys.stderr,
        )
        return 2
    source = {"tasks": args.tasks, "db_dir": args.db_dir} if args.tasks else {"suite": args.suite}
    stopped = serve(
        host=args.host,
        port=args.port,
        ready=lambda: print(
            f"birdenv: serving {args.kind} tasks on http://{args.host}:{args.port} (WebSocket /ws)",
            flush=True,
        ),
        kind=args.kind,
        max_sessions=args.max_sessions,
        idle_timeout=args.idle_timeout or None,
        max_turns=args.max_turns,
        **source,
    )
    if stopped is None:
        return 0
    print(
        f"birdenv: serve stopped by {signal.Signals(stopped).name}: its sessions were closed and "
        "their databases dropped",
        flush=True,
    )
    return 128 + stopped


# -- birdenv doctor ----------------------------------------------------------------------------
def _cmd_doctor(args: argparse.Namespace) -> int:

    root = default_root()
    sessions = default_sessions_dir(root)
    print(f"python           {sys.version.split()[0]}")
    print(f"sqlite (stdlib)  {sqlite3.sqlite_version}")
    print(f"cache            {suites.home()}")
    print(f"replica root     {root}")
    if is_memory_filesystem(sessions):
        print(
            f"sessions         {sessions} (memory; on disk in {root / 'sessions'} while it has "
            f"under {MEMORY_HEADROOM >> 30} GiB free)"
        )
    else:
        print(f"sessions         {sessions} (disk)")
    soft, hard = descriptors.limits()
    print(
        f"open files       soft limit {soft}, hard {hard}: a replica pool raises the soft limit "
        "to the hard one; each open session holds 2-4"
    )
    if overlay.available():
        print("strategy         overlay (copy-on-write page overlay VFS)")
    else:
        print(f"strategy         copy (overlay unavailable: {overlay.unavailable_reason()})")
    print(f"observations     {'Python (' + SPEEDUPS_MISSING + ')' if SPEEDUPS_MISSING else 'C'}")
    # PostgreSQL support loads only for the commands that ask about it
    from birdenv.postgres.server import describe_default

    print(f"postgresql       {describe_default()}")
    return 0


def subcommand(commands: Any, name: str, func: Any, help: str) -> argparse.ArgumentParser:
    """The subcommand ``name`` of ``commands`` (an ``add_subparsers()`` result), run by ``func``:
    the one shape of both command lines' subcommands."""
    parser = commands.add_parser(name, help=help)
    parser.set_defaults(func=func)
    return parser


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="birdenv", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    data = commands.add_parser("data", help="the bundled suites").add_subparsers(
        dest="data_command", required=True
    )
    subcommand(
        data, "list", _cmd_data_list, help="suites, task counts per category, databases and sizes"
    )
    build = subcommand(
        data, "build", _cmd_data_build, help="build (or rebuild) the bundled databases"
    )
    build.add_argument("--force", action="store_true", help="rebuild even when the cache is intact")
    validate = subcommand(
        data,
        "validate",
        _cmd_data_validate,
        help="judge every task's gold (must pass) and issue SQL (must fail)",
    )
    _add_task_source(validate)
    validate.add_argument(
        "--bird",
        metavar="NAME_OR_PATH",
        help="validate BIRD questions instead: bird-mini-train, bird-mini-eval or a file",
    )
    validate.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")

    evaluate = subcommand(
        commands,
        "evaluate",
        _cmd_evaluate,
        help="judge predictions like the official evaluators (BIRD-CRITIC SR, or BIRD EX)",
    )
    evaluate.add_argument(
        "predictions",
        help="BIRD-CRITIC JSONL (task rows with pred_sqls, or instance_id + pred_sqls); or BIRD "
        "predictions: the official JSON object {question_id: 'SQL\\t----- bird -----\\tdb_id'} "
        "or JSONL rows of question_id + pred_sql (or SQL)",
    )
    _add_task_source(evaluate, bird=True)
    evaluate.add_argument(
        "--scorer",
        choices=("auto", "critic", "ex"),
        default="auto",
        help="critic: BIRD-CRITIC's judge (Success Rate by category); ex: BIRD's execution "
        "accuracy by difficulty; auto (default): from --suite, else from the shape of the input",
    )
    evaluate.add_argument(
        "--out", help="verdicts JSONL (default: PRED.verdicts.jsonl beside the input)"
    )
    evaluate.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="worker processes (default 1; with --ray, one per CPU of the cluster)",
    )
    evaluate.add_argument(
        "--ray",
        action="store_true",
        help="judge on Ray workers over the cluster at RAY_ADDRESS (else a local Ray); each node "
        "gets the databases by content hash (needs the ray extra)",
    )
    evaluate.add_argument(
        "--statement-timeout",
        type=float,
        default=None,
        help="seconds per statement (default: none, like the official BIRD-CRITIC evaluator; "
        "30 for BIRD EX, the official meta_time_out)",
    )
    evaluate.add_argument(
        "--instance-timeout",
        type=float,
        default=INSTANCE_TIMEOUT,
        help="seconds per instance; a worker past it is killed (default: the official 180)",
    )
    evaluate.add_argument(
        "--no-cache",
        dest="cache",
        action="store_false",
        help=(
            "run every issue phase again instead of reusing remembered outcomes, and start "
            "instances largest database first (not slowest first by remembered times)"
        ),
    )

    play = subcommand(
        commands, "play", _cmd_play, help="be the agent yourself on a task, in the terminal"
    )
    play.add_argument("task_id", nargs="?", help="task to play (default: one at random)")
    _add_task_source(play)

    demo = subcommand(
        commands,
        "demo",
        _cmd_demo,
        help="build data, run reference agents in the env, evaluate them",
    )
    demo.add_argument("--suite", default="critic-mini", choices=suites.names())
    demo.add_argument("--limit", type=int, default=0, help="only the first N tasks (0: all)")
    demo.add_argument("--out", default="runs/demo", help="where predictions and verdicts go")
    demo.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="judging processes")

    serve = subcommand(
        commands,
        "serve",
        _cmd_serve,
        help="serve the environments to OpenEnv clients (HTTP and WebSocket)",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: loopback only)"
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--kind", default="critic", help="task kind: critic, bird or a registered one"
    )
    serve.add_argument("--suite", help="bundled suite (default: the kind's evaluation suite)")
    serve.add_argument("--tasks", help="task file instead of a suite (databases in --db-dir)")
    serve.add_argument("--db-dir", help="folder holding the databases of --tasks")
    serve.add_argument(
        "--max-sessions", type=int, default=64, help="concurrent WebSocket sessions (default 64)"
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=300.0,
        help="seconds of silence that close a session and free its lease (0: never)",
    )
    serve.add_argument("--max-turns", type=int, help="turns per episode (default: the env's, 5)")

    subcommand(commands, "doctor", _cmd_doctor, help="which replica strategy is in use, and why")
    return parser


def _add_task_source(parser: argparse.ArgumentParser, *, bird: bool = False) -> None:
    if bird:  # no default: the suite, if given, also says which scorer applies
        parser.add_argument(
            "--suite",
            choices=[*suites.names(), *BIRD_SUITES],
            help="bundled suite (default: critic-mini, or bird-mini-eval for BIRD predictions)",
        )
    else:
        parser.add_argument(
            "--suite", default="critic-mini", choices=suites.names(), help="bundled suite"
        )
    parser.add_argument(
        "--tasks",
        help="official task file instead of a bundled suite: BIRD-CRITIC JSONL"
        + (", or BIRD questions (dev.json, mini_dev_sqlite.json or JSONL)" if bird else ""),
    )
    parser.add_argument(
        "--db-dir",
        help="folder holding the databases of --tasks: {db_id}/{db_id}_template.sqlite, or BIRD's "
        "{db_id}/{db_id}.sqlite",
    )
    parser.add_argument("--db-root", dest="db_root", help=argparse.SUPPRESS)  # the old name


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``birdenv`` command.

    Bad input ends in one line on stderr and exit status 2; SIGINT and SIGTERM in one line naming
    the signal, with exit status 130 or 143.
    """
    args = _build_parser().parse_args(argv)
    if getattr(args, "db_root", None):
        print("birdenv: warning: --db-root is deprecated, use --db-dir", file=sys.stderr)
        args.db_dir = args.db_dir or args.db_root
    # SIGTERM unwinds like Ctrl-C: a command's workers, sessions and clusters are ended on the way
    with interrupts_raised():
        try:
            return reporting_interrupts(args.func, args)
        except BirdEnvError as exc:
            print(f"birdenv: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as exc:
            print(f"birdenv: interrupted by {signal_name(exc)}", file=sys.stderr)
            return interrupted_status(exc)


if __name__ == "__main__":
    sys.exit(main())

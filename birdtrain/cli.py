"""The ``birdtrain`` command: the four-stage curriculum, its pieces, evaluation.

    birdtrain curriculum (--preset NAME | --config FILE.yaml) [key=value ...]
    birdtrain synth | stage1 | stage2 | stage3 | stage4 (--preset NAME | --config FILE) [key=value ...]
    birdtrain eval --policy MODEL|oracle|echo|scripted [--suite S | --tasks T --db-dir D] ...
    birdtrain mixture (--preset NAME | --config FILE) [key=value ...]
    birdtrain report RUN_DIR
    birdtrain trajectories RUN_DIR --task ID | --sql QUERY

A run directory ``{output_dir}/{name}/`` holds ``config.json`` (the resolved configuration and the
git commit), ``data/`` (synthesized examples), ``stage1/`` … ``stage4/`` (each with ``metrics.jsonl``,
``checkpoint/`` and ``DONE`` once complete) and ``eval/`` (``eval/<label>/`` the debugging
evaluation, ``eval/<label>-bird/`` execution accuracy on BIRD questions when there are any), and
``mixture.json`` when ``data.mixture`` is ``auto``. Rerunning resumes: completed stages are
skipped and the next one starts from the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from birdtrain.config import STAGES

__all__ = ["main", "run_curriculum"]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _prepare_run(cfg: Any) -> Path:
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "config": cfg.to_dict(),
        "git_commit": _git_commit(),
        "python": sys.version.split()[0],
    }
    (run_dir / "config.json").write_text(json.dumps(record, indent=2))
    return run_dir


def _tasks(cfg: Any, which: str) -> list:
    """The training tasks (a mixture's draw, or the train suite), the evaluation tasks (either
    kind), or ``"bird_eval"``: the BIRD questions scored for execution accuracy (may be empty)."""
    from birdenv.vector import load_source
    from birdtrain.data import load_train_tasks

    if which == "train":
        return load_train_tasks(cfg)
    if which == "bird_eval":
        suite = _bird_eval_suite(cfg)
        if suite is None:
            return []
        tasks = load_source(suite, db_dir=cfg.data.bird_db_root)
    else:
        tasks = load_source(cfg.data.eval_suite, db_dir=cfg.data.eval_db_dir)
    return tasks[: cfg.eval.max_tasks] if cfg.eval.max_tasks else tasks


def _bird_eval_suite(cfg: Any) -> str | None:
    """``data.bird_eval_suite``; ``auto``: bird-mini-eval when training sees BIRD questions."""
    from birdenv.bird import BIRD_SUITES

    suite = cfg.data.bird_eval_suite
    if suite != "auto":
        return suite or None
    mixture = cfg.data.mixture
    if mixture == "auto":
        names = list(cfg.data.mixture_sources)
    else:
        names = list(mixture) if mixture else [cfg.data.train_suite]
    if cfg.data.eval_suite in BIRD_SUITES:
        return None  # the main evaluation already scores BIRD questions
    return "bird-mini-eval" if any(_is_bird_source(n, cfg) for n in names) else None


def _is_bird_source(name: str, cfg: Any) -> bool:
    from birdenv.bird import BIRD_SUITES
    from birdenv.vector import load_source, task_kind

    if name in BIRD_SUITES:
        return True
    tasks = load_source(name, db_dir=cfg.data.db_dir)
    return bool(tasks) and task_kind(tasks[0]) == "bird"


def _resolve_mixture(cfg: Any, run_dir: Path) -> None:
    """``data.mixture: auto`` becomes the weights of the run's ``mixture.json`` (estimated once)."""
    if cfg.data.mixture == "auto":
        from birdtrain.data.mixture import resolve_mixture

        print("[mixture] estimating the weights (data.mixture: auto)")
        weights = resolve_mixture(cfg, run_dir)
        print(f"[mixture] weights: {weights} (evidence in {run_dir / 'mixture.json'})")


def _synth(cfg: Any, run_dir: Path) -> dict[str, Any]:
    from birdtrain.data import synth

    data_dir = run_dir / "data"
    done = data_dir / "DONE"
    if done.is_file():
        return json.loads(done.read_text())
    counts = synth(cfg, data_dir)
    done.write_text(json.dumps(counts))
    return counts


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_stage(cfg: Any, stage: str, model_path: str, run_dir: Path) -> str:
    """Run one stage unless its DONE marker exists; return the checkpoint the next stage starts from."""
    out_dir = run_dir / stage
    done = out_dir / "DONE"
    if done.is_file():
        print(f"[{stage}] already complete: {out_dir / 'checkpoint'}")
        return str(out_dir / "checkpoint")
    if not getattr(cfg, stage).enabled:
        print(f"[{stage}] disabled in the configuration; skipped")
        return model_path
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"[{stage}] starting from {model_path}")
    if stage in ("stage1", "stage2"):
        from birdtrain.stages import sft

        _synth(cfg, run_dir)
        examples = _read_jsonl(run_dir / "data" / f"{stage}.jsonl")
        checkpoint = sft.run(
            cfg, model_path=model_path, out_dir=out_dir, examples=examples, stage=int(stage[-1])
        )
    elif stage == "stage3":
        from birdtrain.stages import grpo

        checkpoint = grpo.run(
            cfg, model_path=model_path, out_dir=out_dir, tasks=_tasks(cfg, "train")
        )
    else:
        from birdtrain.stages import agentic

        checkpoint = agentic.run(
            cfg, model_path=model_path, out_dir=out_dir, tasks=_tasks(cfg, "train")
        )
    elapsed = time.perf_counter() - started
    done.write_text(json.dumps({"checkpoint": str(checkpoint), "seconds": round(elapsed, 1)}))
    print(f"[{stage}] done in {elapsed:.1f} s: {checkpoint}")
    return str(checkpoint)


def _last_checkpoint(cfg: Any, run_dir: Path, before: str) -> str:
    """The checkpoint a stage starts from: the latest completed earlier stage, else the base model."""
    from birdtrain.models import resolve_model

    for stage in reversed(STAGES[: STAGES.index(before)]):
        if (run_dir / stage / "DONE").is_file():
            return str(run_dir / stage / "checkpoint")
    return resolve_model(cfg.model.name_or_path)


def _evaluate(cfg: Any, model_path: str, run_dir: Path, label: str) -> dict[str, Any] | None:
    if not cfg.eval.enabled:
        return None
    summary = _evaluate_on(
        cfg, model_path, run_dir, label, _tasks(cfg, "eval"), label, cfg.data.eval_suite
    )
    bird = _tasks(cfg, "bird_eval")
    if bird:
        # Generation beside debugging: execution accuracy on BIRD questions, same policy and turns.
        summary = dict(summary)
        summary["generation"] = _evaluate_on(
            cfg, model_path, run_dir, label, bird, f"{label}-bird", _bird_eval_suite(cfg)
        )
    return summary


def _evaluate_on(
    cfg: Any, model_path: str, run_dir: Path, label: str, tasks: list, folder: str, suite: str
) -> dict[str, Any]:
    from birdtrain.evaluate import evaluate_policy

    out_dir = run_dir / "eval" / folder
    summary_path = out_dir / "summary.json"
    if summary_path.is_file():
        return json.loads(summary_path.read_text())
    return evaluate_policy(
        model_path,
        tasks=tasks,
        out_dir=out_dir,
        mode="agent",
        max_turns=cfg.eval.max_turns,
        max_new_tokens=cfg.eval.max_new_tokens,
        temperature=cfg.eval.temperature,
        label=label,
        suite=suite,
    )


def run_curriculum(cfg: Any) -> dict[str, Any]:
    """Run (or resume) stages 1→4, evaluating before and after the stages of ``eval.after``.

    Returns the summaries: ``before``, ``after_<stage>`` for each stage of ``eval.after``,
    ``after`` (the final model's, when stage 4 is evaluated) and ``run_dir``.
    """
    from birdtrain.models import resolve_model

    run_dir = _prepare_run(cfg)
    _resolve_mixture(cfg, run_dir)
    base = resolve_model(cfg.model.name_or_path)
    results: dict[str, Any] = {"run_dir": str(run_dir), "mixture": cfg.data.mixture}
    results["before"] = _evaluate(cfg, base, run_dir, "before") if cfg.eval.before else None
    model_path = _last_checkpoint(cfg, run_dir, "stage1")
    for stage in STAGES:
        model_path = _run_stage(cfg, stage, model_path, run_dir)
        if stage in cfg.eval.after:
            label = f"after_{stage}"
            results[label] = _evaluate(cfg, model_path, run_dir, label)
    # "after": the evaluation of the final model, when eval.after asks for one.
    results["after"] = results.get(f"after_{STAGES[-1]}")
    try:
        from birdtrain.report import write_report

        results["report"] = str(write_report(run_dir))
    except ImportError:
        pass
    (run_dir / "summary.json").write_text(json.dumps(results, indent=2, default=str))
    return results


def _config_from(args: argparse.Namespace) -> Any:
    from birdtrain.config import load_config

    if not args.preset and not args.config:
        raise SystemExit("birdtrain: give --preset NAME or --config FILE.yaml")
    cfg = load_config(args.preset, args.config, args.overrides)
    if args.output_dir:
        cfg.output_dir = args.output_dir
    return cfg


def _cmd_curriculum(args: argparse.Namespace) -> int:
    cfg = _config_from(args)
    results = run_curriculum(cfg)
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


def _cmd_synth(args: argparse.Namespace) -> int:
    cfg = _config_from(args)
    run_dir = _prepare_run(cfg)
    _resolve_mixture(cfg, run_dir)
    counts = _synth(cfg, run_dir)
    print(json.dumps(counts, indent=2))
    return 0


def _cmd_stage(args: argparse.Namespace) -> int:
    cfg = _config_from(args)
    run_dir = _prepare_run(cfg)
    _resolve_mixture(cfg, run_dir)
    start = args.model or _last_checkpoint(cfg, run_dir, args.command)
    print(_run_stage(cfg, args.command, start, run_dir))
    return 0


def _cmd_mixture(args: argparse.Namespace) -> int:
    from birdtrain.data.mixture import choose_mixture

    cfg = _config_from(args)
    run_dir = _prepare_run(cfg)
    record = choose_mixture(cfg, run_dir)
    for candidate in record["candidates"]:
        weights = ", ".join(f"{k} {v:.2f}" for k, v in candidate["weights"].items())
        gains = ", ".join(f"{k} {v:+.3f}" for k, v in candidate["improvement"].items())
        print(f"{weights:<40} held-out improvement: {gains}   score {candidate['score']:+.4f}")
    print(f"chosen: {record['chosen']} ({run_dir / 'mixture.json'})")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from birdenv.vector import load_source
    from birdtrain.evaluate import evaluate_policy

    tasks = (
        load_source(args.tasks, db_dir=args.db_dir or args.db_root)
        if args.tasks
        else load_source(args.suite)
    )
    if args.limit:
        tasks = tasks[: args.limit]
    policy = args.policy
    if args.endpoint:
        policy = f"endpoint:{args.endpoint_model}@{args.endpoint}"
    summary = evaluate_policy(
        policy,
        tasks=tasks,
        out_dir=Path(args.out),
        mode=args.mode,
        n=args.n,
        temperature=args.temperature,
        max_turns=args.max_turns,
        max_new_tokens=args.max_new_tokens,
        num_envs=args.num_envs,
        engine=args.engine,
        label=args.label or Path(str(args.policy)).name,
        suite=args.tasks or args.suite,
    )
    print(summary["table"])
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from birdtrain.report import write_report

    print(write_report(args.run_dir))
    return 0


def _cmd_trajectories(args: argparse.Namespace) -> int:
    from birdtrain.trajectories import TrajectoryStore

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
    parser.add_argument("--preset", help="smoke, smollm or paper-7b")
    parser.add_argument("--config", help="YAML file; its keys override the preset's")
    parser.add_argument("--output-dir", help="parent folder of run directories (default: runs)")
    parser.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. stage3.learning_rate=1e-6"
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="birdtrain", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    curriculum = commands.add_parser(
        "curriculum", help="run (or resume) stages 1-4 with evaluation"
    )
    _add_config_args(curriculum)
    curriculum.set_defaults(func=_cmd_curriculum)
    synth = commands.add_parser("synth", help="synthesize the stage-1 and stage-2 data only")
    _add_config_args(synth)
    synth.set_defaults(func=_cmd_synth)
    mixture = commands.add_parser(
        "mixture",
        help="estimate mixture weights by proxy runs scored on held-out tasks (mixture.json)",
    )
    _add_config_args(mixture)
    mixture.set_defaults(func=_cmd_mixture)
    for stage in STAGES:
        sub = commands.add_parser(stage, help=f"run {stage} only (resumes from the run directory)")
        _add_config_args(sub)
        sub.add_argument("--model", help="start from this checkpoint instead of the run's latest")
        sub.set_defaults(func=_cmd_stage)

    ev = commands.add_parser(
        "eval", help="evaluate a policy on BIRD-CRITIC-style tasks (SR) or BIRD questions (EX)"
    )
    ev.add_argument(
        "--policy",
        default="scripted",
        help="model path or name (tiny, smollm), or oracle/echo/scripted",
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
    ev.add_argument("--n", type=int, default=1, help="samples per task (pass@k)")
    ev.add_argument("--temperature", type=float, default=0.0)
    ev.add_argument("--max-turns", type=int, default=5)
    ev.add_argument("--max-new-tokens", type=int, default=512)
    ev.add_argument("--num-envs", type=int, default=8, help="parallel environments")
    ev.add_argument(
        "--engine",
        choices=("auto", "vllm", "transformers"),
        default="auto",
        help="generation for a local model (auto: vLLM when installed with a GPU)",
    )
    ev.add_argument("--out", default="runs/eval", help="output folder")
    ev.add_argument("--label", help="name of this policy in reports")
    ev.set_defaults(func=_cmd_eval)

    report = commands.add_parser("report", help="write RUN_DIR/report/report.html")
    report.add_argument("run_dir")
    report.set_defaults(func=_cmd_report)
    traj = commands.add_parser(
        "trajectories", help="print a task's trajectories, or query the store"
    )
    traj.add_argument("run_dir", help="a run directory or an eval output folder")
    traj.add_argument("--task", help="task id")
    traj.add_argument("--limit", type=int, default=3, help="most recent trajectories to show")
    traj.add_argument("--sql", help="SQL over the table 'trajectories' (DuckDB)")
    traj.set_defaults(func=_cmd_trajectories)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``birdtrain`` command."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    args = _build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"birdtrain: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

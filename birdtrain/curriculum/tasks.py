"""Which tasks each part of a run trains or is evaluated on."""

from __future__ import annotations

from birdenv.tasks import BIRD_SUITES, load_tasks, source_kind
from birdtrain.config import CurriculumConfig
from birdtrain.data import load_train_tasks

__all__ = ["bird_eval_suite", "rl_tasks", "tasks_for"]

#: The evaluation suite of BIRD questions (``data.bird_eval_suite: auto``).
BIRD_EVAL = "bird-mini-eval"


def tasks_for(cfg: CurriculumConfig, which: str) -> list:
    """The training tasks (a mixture's draw, or the train suite), the evaluation tasks (either
    kind), or ``"bird_eval"``: the BIRD questions scored for execution accuracy (may be empty)."""
    if which == "train":
        return load_train_tasks(cfg)
    if which == "bird_eval":
        suite = bird_eval_suite(cfg)
        if suite is None:
            return []
        tasks = load_tasks(suite, db_dir=cfg.data.bird_db_root)
    else:
        tasks = load_tasks(cfg.data.eval_suite, db_dir=cfg.data.eval_db_dir)
    return tasks[: cfg.eval.max_tasks] if cfg.eval.max_tasks else tasks


def rl_tasks(cfg: CurriculumConfig, stage: str) -> list:
    """The training tasks an RL stage draws from: the first ``max_tasks`` of them, or all."""
    return tasks_for(cfg, "train")[: getattr(cfg, stage).max_tasks]


def bird_eval_suite(cfg: CurriculumConfig) -> str | None:
    """``data.bird_eval_suite``; ``auto``: bird-mini-eval when training sees BIRD questions."""
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
    # bird-mini-eval when a source holds the kind of task it evaluates.
    return BIRD_EVAL if any(source_kind(n).eval_suite == BIRD_EVAL for n in names) else None

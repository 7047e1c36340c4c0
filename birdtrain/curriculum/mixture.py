"""Choosing a mixture's weights: a step of the curriculum (``data.mixture: auto``, or
``birdtrain mixture``).

:func:`choose_mixture` runs one short proxy training per candidate setting and scores each on
held-out tasks of every source; see its docstring for the estimate and :data:`METHOD` for its name
in ``mixture.json``. Mixtures themselves (parsing, drawing by weight) are data:
:mod:`birdtrain.data.mixture`.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Sequence
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from birdtrain.config import CurriculumConfig
from birdtrain.data import make_teacher
from birdtrain.data.kinds import by_kind, training_kind
from birdtrain.data.mixture import load_sources, mix_tasks, split_holdout
from birdtrain.models import inference_device, load_policy, resolve_model
from birdtrain.stages import sft

__all__ = [
    "METHOD",
    "candidate_weights",
    "choose_mixture",
    "heldout_loss",
    "resolve_mixture",
]

#: The weight estimate :func:`choose_mixture` implements, as recorded in ``mixture.json``.
METHOD = "proxy-sft-heldout-loss"


def candidate_weights(names: Sequence[str], grid: int) -> list[dict[str, float]]:
    """Every weight setting on the simplex with steps of ``1/grid`` and no source left out.

    >>> candidate_weights(["a", "b"], 4)
    [{'a': 0.25, 'b': 0.75}, {'a': 0.5, 'b': 0.5}, {'a': 0.75, 'b': 0.25}]
    """
    k = len(names)
    if k == 1:
        return [{names[0]: 1.0}]
    if grid < k:
        raise ValueError(f"data.mixture_grid must be at least the number of sources ({k})")
    out = []
    # Compositions of grid into k positive parts, via k-1 cut points.
    for cuts in combinations(range(1, grid), k - 1):
        parts = np.diff([0, *cuts, grid])
        out.append({n: float(p) / grid for n, p in zip(names, parts, strict=True)})
    return out


def heldout_loss(
    model: Any, tokenizer: Any, examples: Sequence[dict[str, Any]], max_length: int
) -> float:
    """Mean per-token negative log-likelihood of the examples' completions given their prompts.

    Examples are stage-1 ``{"prompt", "completion"}`` chats. A sequence longer than ``max_length``
    keeps its last ``max_length`` tokens, so the completion is always scored.
    """
    # the train extra: imported only where used
    import torch

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        for example in examples:
            prompt = tokenizer.apply_chat_template(
                example["prompt"], add_generation_prompt=True, tokenize=False
            )
            full = tokenizer.apply_chat_template(
                example["prompt"] + example["completion"], tokenize=False
            )
            if not full.startswith(prompt):
                raise ValueError("the chat template renders the prompt differently in the chat")
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            completion_ids = tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]
            ids = (prompt_ids + completion_ids)[-max_length:]
            scored = min(len(completion_ids), len(ids) - 1)
            input_ids = torch.tensor([ids], device=device)
            with torch.no_grad():
                logits = model(input_ids=input_ids).logits[0, :-1].float()
            targets = input_ids[0, 1:]
            nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
            total += float(nll[-scored:].sum())
            tokens += scored
    finally:
        model.train(was_training)
    return total / max(tokens, 1)


def _stage1_examples(tasks: Sequence[Any], cfg: CurriculumConfig) -> dict[str, dict[str, Any]]:
    """Stage-1 examples for ``tasks`` of any kind (each by its
    :class:`~birdtrain.data.kinds.TrainingKind`), by task id (offline or the teacher)."""
    teacher = make_teacher(cfg)
    examples = [
        example
        for kind, group in by_kind(tasks).items()
        for example in training_kind(kind).reasoning_examples(
            group, teacher=teacher, progress=False
        )
    ]
    return {e["task_id"]: e for e in examples}


def choose_mixture(
    cfg: CurriculumConfig, out_dir: str | Path, *, model_path: str | None = None
) -> dict:
    """Estimate the mixture weights by short proxy runs scored on held-out tasks of every source.

    The estimate (``METHOD = "proxy-sft-heldout-loss"``):

    1. From each source in ``data.mixture_sources``, ``data.mixture_holdout`` tasks are held out
       (a seeded draw); stage-1 examples (reasoning + the gold solution) are built for the rest
       and for the held-out tasks.
    2. The base model's held-out loss is measured per source: the mean per-token negative
       log-likelihood of the held-out gold answers (:func:`heldout_loss`). A continuous score,
       unlike a success rate, it moves after a few steps even for a small model.
    3. For every candidate weight setting (:func:`candidate_weights` with ``data.mixture_grid``),
       a proxy copy of the base model is trained for ``data.mixture_proxy_steps`` stage-1 steps on
       examples drawn by those weights (:func:`mix_tasks`, same seed), then scored the same way.
    4. A candidate's score is the mean over sources of its relative held-out improvement,
       ``(base_loss - proxy_loss) / base_loss``: every task kind counts equally whatever its
       size or its loss scale, so a setting that helps one kind by hurting the other scores low.
       The best score wins; ties go to the most even setting.

    Writes ``out_dir/mixture.json``: the method, the sources, the held-out task ids, the base
    losses, every candidate's losses, improvements, score and training time, and ``chosen``.
    Returns that record.
    """

    data = cfg.data
    names = list(data.mixture_sources)
    if not names:
        raise ValueError("data.mixture_sources names no task source")
    out_dir = Path(out_dir)
    work = out_dir / "mixture"
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model_path = model_path or resolve_model(cfg.model.name_or_path)
    sources = load_sources(names, data.db_dir)
    train, held = split_holdout(sources, data.mixture_holdout, cfg.seed)
    per_step = cfg.stage1.batch_size
    budget = data.mixture_proxy_steps * per_step
    candidates = candidate_weights(names, data.mixture_grid)
    # The most any candidate draws from one source: build examples for that many tasks only.
    need = {n: min(len(train[n]), budget) for n in names}
    pool = {n: train[n][: need[n]] for n in names}
    built = _stage1_examples([t for n in names for t in pool[n] + held[n]], cfg)
    train_examples = {
        n: [built[t.instance_id] for t in pool[n] if t.instance_id in built] for n in names
    }
    held_examples = {
        n: [built[t.instance_id] for t in held[n] if t.instance_id in built] for n in names
    }
    for n in names:
        if not held_examples[n] or not train_examples[n]:
            raise ValueError(
                f"task source {n!r}: no stage-1 example could be built to estimate with"
            )
    max_length = cfg.stage1.max_length

    model, tokenizer = load_policy(model_path, dtype=cfg.model.dtype, device=inference_device())
    base = {n: heldout_loss(model, tokenizer, held_examples[n], max_length) for n in names}
    del model
    results = []
    for i, weights in enumerate(candidates):
        t0 = time.perf_counter()
        proxy_cfg = copy.deepcopy(cfg)
        proxy_cfg.stage1.max_steps = data.mixture_proxy_steps
        proxy_cfg.report_to = []
        examples = mix_tasks(train_examples, weights, total=budget, seed=cfg.seed)
        trainer = sft.build_trainer(
            proxy_cfg,
            model_path=model_path,
            out_dir=work / f"candidate-{i}",
            examples=examples,
            stage=1,
        )
        trainer.train()
        losses = {
            n: heldout_loss(trainer.model, trainer.processing_class, held_examples[n], max_length)
            for n in names
        }
        improvement = {n: (base[n] - losses[n]) / base[n] if base[n] else 0.0 for n in names}
        results.append(
            {
                "weights": weights,
                "heldout_loss": losses,
                "improvement": improvement,
                "score": sum(improvement.values()) / len(names),
                "train_examples": len(examples),
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
        del trainer
    best = max(results, key=lambda r: (round(r["score"], 9), -max(r["weights"].values())))
    record = {
        "method": METHOD,
        "sources": names,
        "seed": cfg.seed,
        "proxy_steps": data.mixture_proxy_steps,
        "proxy_examples_per_step": per_step,
        "heldout": {n: [t.instance_id for t in held[n]] for n in names},
        "base_model": str(model_path),
        "base_heldout_loss": base,
        "candidates": results,
        "chosen": best["weights"],
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out_dir / "mixture.json").write_text(json.dumps(record, indent=2))
    return record


def resolve_mixture(cfg: CurriculumConfig, run_dir: str | Path) -> dict[str, float] | None:
    """The run's mixture weights: as configured, or for ``auto`` the run's ``mixture.json``
    (estimated now with :func:`choose_mixture` when it is not there yet). Sets ``cfg.data.mixture``.
    """
    mixture = cfg.data.mixture
    if mixture != "auto":
        return mixture
    path = Path(run_dir) / "mixture.json"
    record = json.loads(path.read_text()) if path.is_file() else choose_mixture(cfg, run_dir)
    cfg.data.mixture = dict(record["chosen"])
    return cfg.data.mixture

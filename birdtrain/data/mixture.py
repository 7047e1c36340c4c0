"""Mixtures of task sources: debugging tasks and BIRD questions in one curriculum, by weight.

A mixture maps task sources (bundled suite names or files, see :func:`birdenv.tasks.load_tasks`)
to weights, e.g. ``{"gym-mini": 0.7, "bird-mini-train": 0.3}``. Every stage draws from it:
stages 1-2 synthesize their examples for the mixed task list, stage 3 takes its prompts from it
(rewards by task kind: the judge or execution accuracy), stage 4 rolls it out in one vector env
holding both environments.

Drawing by weight (:func:`mix_tasks`) is deterministic given the seed: each source's tasks are
shuffled with a generator seeded by ``(seed, source index)``, a source of weight ``w`` contributes
``w * total`` tasks (largest-remainder rounding, so the counts are exact), and the sources are
interleaved by one more seeded shuffle. ``total`` defaults to the largest list that repeats no
task; a larger one cycles through a source's tasks again.

Choosing the weights (``data.mixture: auto``, or ``birdtrain mixture``): :func:`choose_mixture`
runs one short proxy training per candidate setting and scores each on held-out tasks of every
source; see its docstring for the estimate and :data:`METHOD` for its name in ``mixture.json``.
"""

from __future__ import annotations

import copy
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "METHOD",
    "apportion",
    "candidate_weights",
    "choose_mixture",
    "heldout_loss",
    "load_sources",
    "mix_tasks",
    "normalize",
    "parse_mixture",
    "resolve_mixture",
    "split_holdout",
]

#: The weight estimate :func:`choose_mixture` implements, as recorded in ``mixture.json``.
METHOD = "proxy-sft-heldout-loss"

_PAIR = re.compile(r"^\s*([^:=,\s][^:=,]*?)\s*[:=]\s*([^,]+?)\s*$")


def parse_mixture(value: Any) -> dict[str, float] | str | None:
    """A mixture from configuration: a mapping, ``"auto"``, ``"name:w,name:w"`` text, or None.

    Weights must be finite non-negative numbers, not all 0; they need not sum to 1.

    >>> parse_mixture("gym-mini:0.7, bird-mini-train=0.3")
    {'gym-mini': 0.7, 'bird-mini-train': 0.3}
    >>> parse_mixture({"gym-mini": 3, "bird-mini-train": 1})
    {'gym-mini': 3.0, 'bird-mini-train': 1.0}
    >>> parse_mixture("auto"), parse_mixture(None)
    ('auto', None)
    >>> parse_mixture({"gym-mini": -1})
    Traceback (most recent call last):
    ...
    ValueError: data.mixture: the weight of 'gym-mini' must be a finite number >= 0, got -1
    """
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        pairs = {}
        for item in value.split(","):
            match = _PAIR.match(item)
            if not match:
                raise ValueError(
                    f"data.mixture: cannot read {item.strip()!r}; write NAME:WEIGHT pairs "
                    "separated by commas (gym-mini:0.7,bird-mini-train:0.3), a mapping, or auto"
                )
            pairs[match.group(1)] = match.group(2)
        value = pairs
    if not isinstance(value, Mapping) or not value:
        raise ValueError(
            "data.mixture must map task sources to weights, e.g. "
            "{gym-mini: 0.7, bird-mini-train: 0.3}, or be 'auto'"
        )
    out: dict[str, float] = {}
    for name, weight in value.items():
        try:
            number = float(weight)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(weight, bool) or not math.isfinite(number) or number < 0:
            raise ValueError(
                f"data.mixture: the weight of {name!r} must be a finite number >= 0, got {weight!r}"
            )
        out[str(name)] = number
    if sum(out.values()) <= 0:
        raise ValueError("data.mixture: the weights are all 0")
    return out


def normalize(weights: Mapping[str, float]) -> dict[str, float]:
    """Weights scaled to sum to 1.

    >>> normalize({"a": 3, "b": 1})
    {'a': 0.75, 'b': 0.25}
    """
    total = float(sum(weights.values()))
    if total <= 0:
        raise ValueError("weights must not all be 0")
    return {name: float(w) / total for name, w in weights.items()}


def apportion(weights: Mapping[str, float], total: int) -> dict[str, int]:
    """Integer counts summing to ``total``, proportional to ``weights`` (largest remainder).

    >>> apportion({"a": 0.7, "b": 0.3}, 10), apportion({"a": 1, "b": 1, "c": 1}, 4)
    ({'a': 7, 'b': 3}, {'a': 2, 'b': 1, 'c': 1})
    """
    shares = {name: w * total for name, w in normalize(weights).items()}
    counts = {name: math.floor(s + 1e-9) for name, s in shares.items()}
    left = total - sum(counts.values())
    # Ties go to the earlier source, so the result depends on nothing but the arguments.
    order = sorted(shares, key=lambda n: -(shares[n] - counts[n]))
    for name in order[:left]:
        counts[name] += 1
    return counts


def _permutation(n: int, seed: int, index: int) -> np.ndarray:
    return np.random.default_rng([seed, index]).permutation(n)


def mix_tasks(
    sources: Mapping[str, Sequence[Any]],
    weights: Mapping[str, float],
    *,
    total: int | None = None,
    seed: int = 0,
) -> list[Any]:
    """A seeded, reproducible draw of ``total`` items from ``sources`` in the ``weights``' proportions.

    Args:
        sources: Source name → its items (tasks, or examples).
        weights: Source name → weight (the same names as ``sources``).
        total: How many items; default the most that repeats none
            (``min(len(source) / weight)`` over the sources with a weight).
        seed: The draw's seed; the same arguments give the same list.

    Returns:
        The items, sources interleaved; source ``s`` holds exactly ``apportion(weights, total)[s]``.
    """
    if set(sources) != set(weights):
        raise ValueError(f"weights name {sorted(weights)} but the sources are {sorted(sources)}")
    shares = normalize(weights)
    names = list(sources)
    if total is None:
        total = int(
            min(len(sources[n]) / shares[n] for n in names if shares[n] > 0 and len(sources[n]))
            if any(shares[n] > 0 and len(sources[n]) for n in names)
            else 0
        )
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    counts = apportion({n: shares[n] for n in names}, total)
    queues: dict[str, list[Any]] = {}
    for index, name in enumerate(names):
        items, need = list(sources[name]), counts[name]
        if need and not items:
            raise ValueError(f"task source {name!r} is empty but has weight {shares[name]:.3g}")
        drawn: list[Any] = []
        rounds = 0
        while len(drawn) < need:
            # Each pass over the source is a new permutation: repeats are spread, not blocks.
            drawn += [items[i] for i in _permutation(len(items), seed + rounds, index)]
            rounds += 1
        queues[name] = drawn[:need]
    labels = [name for name in names for _ in range(counts[name])]
    order = np.random.default_rng([seed, len(names)]).permutation(len(labels))
    cursor = dict.fromkeys(names, 0)
    mixed = []
    for i in order:
        name = labels[i]
        mixed.append(queues[name][cursor[name]])
        cursor[name] += 1
    return mixed


def load_sources(names: Sequence[str], db_dir: str | None = None) -> dict[str, list[Any]]:
    """The tasks of each named source (:func:`birdenv.tasks.load_tasks`); ids must not collide."""
    from birdenv.tasks import load_tasks

    sources: dict[str, list[Any]] = {}
    owner: dict[str, str] = {}
    for name in names:
        tasks = load_tasks(name, db_dir=db_dir)
        if not tasks:
            raise ValueError(f"task source {name!r} holds no tasks")
        for task in tasks:
            other = owner.setdefault(task.instance_id, name)
            if other != name:
                raise ValueError(
                    f"task id {task.instance_id!r} is in both {other!r} and {name!r}: ids must be "
                    "unique across the sources of a mixture"
                )
        sources[name] = tasks
    return sources


def split_holdout(
    sources: Mapping[str, Sequence[Any]], per_source: int, seed: int
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """(train, held out): ``per_source`` tasks of each source held out, drawn with ``seed``."""
    train, held = {}, {}
    for index, (name, tasks) in enumerate(sources.items()):
        if len(tasks) <= per_source:
            raise ValueError(
                f"task source {name!r} has {len(tasks)} tasks: too few to hold out {per_source} "
                "(lower data.mixture_holdout)"
            )
        order = [tasks[i] for i in _permutation(len(tasks), seed, index)]
        held[name], train[name] = order[:per_source], order[per_source:]
    return train, held


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


def _stage1_examples(tasks: Sequence[Any], cfg: Any) -> dict[str, dict[str, Any]]:
    """Stage-1 examples for ``tasks`` of either kind, by task id (offline or the teacher)."""
    from birdenv.bird import BirdTask
    from birdenv.tasks import Task
    from birdtrain.data import build_reasoning_examples, make_teacher
    from birdtrain.data.bird import build_bird_reasoning_examples

    teacher = make_teacher(cfg)
    critic = [t for t in tasks if isinstance(t, Task)]
    bird = [t for t in tasks if isinstance(t, BirdTask)]
    examples = build_reasoning_examples(critic, teacher=teacher, progress=False) if critic else []
    if bird:
        examples += build_bird_reasoning_examples(bird, teacher=teacher)
    return {e["task_id"]: e for e in examples}


def choose_mixture(cfg: Any, out_dir: str | Path, *, model_path: str | None = None) -> dict:
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
    from birdtrain.models import resolve_model
    from birdtrain.stages import sft

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

    from birdtrain.models import inference_device, load_policy

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


def resolve_mixture(cfg: Any, run_dir: str | Path) -> dict[str, float] | None:
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

"""The curriculum's stages, one module each, all with the same contract.

``run(cfg, *, model_path, out_dir, **inputs) -> Path`` trains from ``model_path``, writes
``out_dir/metrics.jsonl`` (one JSON object per logging step), saves a full checkpoint (LoRA merged)
with its tokenizer to ``out_dir/"checkpoint"`` and returns that path.

- :mod:`birdtrain.stages.sft`: stage 1 (reasoning imitation) and stage 2 (tool-use imitation).
- :mod:`birdtrain.stages.grpo`: stage 3 (single-turn GRPO rewarded by the judge).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "StageError",
    "check_batches",
    "checkpointing",
    "finish_stage",
    "prompt_groups",
    "save_checkpoint",
    "silence_trl_experimental",
    "stage_actor",
    "train",
    "trainer_device_args",
    "write_metrics",
]


class StageError(ValueError):
    """A stage cannot train as configured (the message names the setting to change)."""


def check_batches(stage: str, rows: int, per_step: int, key: str) -> None:
    """Refuse a data set smaller than one step's batch.

    TRL's GRPO sampler drops an incomplete batch, so 3 tasks with 4 per step would train zero
    steps and still "finish".
    """
    if rows < per_step:
        raise StageError(
            f"{stage}: {rows} training task(s) left but {stage}.{key}={per_step}; one optimizer "
            f"step needs {per_step}: lower {stage}.{key} to at most {rows}, or train on more tasks"
        )


def prompt_groups(prompts: list[Any]) -> tuple[list[str], int]:
    """The distinct tasks of a GRPO generation batch, and the group size.

    A GRPO stage's dataset row names its task as the (conversational) prompt's content; TRL 1.16
    hands ``rollout_func`` each prompt repeated ``num_generations`` times in a row.
    """
    ids = [p[-1]["content"] if isinstance(p, list) else str(p) for p in prompts]
    unique = list(dict.fromkeys(ids))
    group = len(ids) // len(unique)
    if [t for t in unique for _ in range(group)] != ids:
        raise RuntimeError(f"expected each prompt repeated {group} times in a row, got {ids}")
    return unique, group


def stage_actor(trainer: Any, use_vllm: bool, policy: Any = None) -> Any:
    """The sampler of a GRPO stage's rollouts: ``policy(trainer)`` when given (scripted actors,
    tests), else the trainer's vLLM engine (``use_vllm``) or the trained model itself."""
    from birdtrain import policies

    if policy is not None:
        return policy(trainer)
    if use_vllm:
        return policies.VLLMPolicy(trainer)
    model = trainer.accelerator.unwrap_model(trainer.model)
    return policies.TransformersPolicy(model, trainer.processing_class)


def finish_stage(trainer: Any, stage: str, out_dir: Path, extra: Any = None) -> Path:
    """After ``trainer.train()``: refuse a run of zero optimizer steps, write ``metrics.jsonl``,
    save the merged checkpoint; return its path."""
    if trainer.state.global_step == 0:
        raise StageError(
            f"{stage} ran zero optimizer steps (its data loader yielded no full batch): lower its "
            "batch size or train on more examples; no checkpoint was saved"
        )
    write_metrics(trainer.state.log_history, out_dir / "metrics.jsonl", extra=extra)
    return save_checkpoint(trainer.model, trainer.processing_class, out_dir / "checkpoint")


def checkpointing(save_steps: int) -> dict[str, Any]:
    """``TrainingArguments`` keywords for a stage's intermediate checkpoints (``save_steps``, 0:
    none; the final, merged save is :func:`save_checkpoint`'s). Only the newest is kept: it holds
    the optimizer state, several times the model's size."""
    if not save_steps:
        return {"save_strategy": "no"}
    return {"save_strategy": "steps", "save_steps": save_steps, "save_total_limit": 1}


def train(trainer: Any) -> None:
    """``trainer.train()``, resumed from the newest intermediate checkpoint in the trainer's
    output folder when an earlier, interrupted run left one, and quiet unless transformers logs
    more than errors (``birdtrain -v``): no progress bar and no printed line per logging step (the
    steps' metrics still reach ``metrics.jsonl``).

    The model, optimizer, schedule, RNG states, step count and log history come back; the data
    loader skips the batches already trained on. A stage's own sampling state (dynamic
    sampling's replacement draws) starts afresh.
    """
    from transformers.trainer_utils import get_last_checkpoint

    out = Path(trainer.args.output_dir)
    last = get_last_checkpoint(str(out)) if out.is_dir() else None
    if last is not None:
        print(f"resuming from {last}")
    _quiet_steps(trainer)
    trainer.train(resume_from_checkpoint=last)


def trainer_device_args(model: Any) -> dict[str, Any]:
    """``TrainingArguments`` keywords for this machine and the ``model`` settings
    (:class:`~birdtrain.config.ModelConfig`): CPU when there is no CUDA, bf16/fp16 on GPU, and
    ``model.gradient_checkpointing``."""
    import torch

    # TRL turns checkpointing on by default; pass it either way, by its current keyword (TRL's
    # configs set the deprecated ``gradient_checkpointing`` alias, which warns when it is used).
    args: dict[str, Any] = {"activation_checkpointing": model.gradient_checkpointing}
    if not torch.cuda.is_available():
        return {**args, "use_cpu": True, "bf16": False, "fp16": False}
    return {**args, "bf16": model.dtype == "bfloat16", "fp16": model.dtype == "float16"}


def _quiet_steps(trainer: Any) -> None:
    """Drop the trainer's progress bar and its printed line per logging step when transformers logs
    errors only (``birdtrain`` without ``-v``)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging

    if logging.get_verbosity() > logging.WARNING:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)


def write_metrics(
    log_history: list[dict[str, Any]], path: Path, extra: Any = None
) -> list[dict[str, Any]]:
    """Write the trainer's log history to ``path`` as JSON lines, one object per logging step.

    ``extra(entry) -> dict`` adds a stage's own metrics to each entry. The trainer's closing summary
    (``train_runtime``, ``train_loss``…) is the last line. Returns the written records.
    """
    records = []
    for entry in log_history:
        record = dict(entry)
        if extra is not None:
            record.update(extra(record))
        records.append(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return records


def save_checkpoint(model: Any, tokenizer: Any, path: Path) -> Path:
    """Save a full checkpoint of ``model`` (LoRA adapters merged in) and its tokenizer at ``path``."""
    # A peft model saves adapters only; later stages and evaluation load a plain checkpoint.
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def silence_trl_experimental() -> None:
    """TRL warns on every import of its experimental parts; we use them on purpose."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

"""What a stage leaves behind: its metrics, the importance-mask warning and the merged checkpoint."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from birdtrain.errors import OutputWriteError
from birdtrain.prompts import record_prompt
from birdtrain.rundir import commit_folder
from birdtrain.stages.training import StageError

logger = logging.getLogger(__name__)

__all__ = ["IS_RATIO_MIN", "finish_stage", "masked_steps", "save_checkpoint", "write_metrics"]


def finish_stage(
    trainer: Any, stage: str, out_dir: Path, *, prompt: Any, extra: Any = None
) -> Path:
    """After ``trainer.train()``: refuse a run of zero optimizer steps, write ``metrics.jsonl``,
    save the merged checkpoint with the prompt setting ``prompt`` it was trained on; return its
    path.

    The checkpoint is written to a temporary folder and renamed into place with a manifest of its
    files (:func:`birdtrain.rundir.commit_folder`): ``checkpoint/`` is whole or absent."""
    if trainer.state.global_step == 0:
        raise StageError(
            f"{stage} ran zero optimizer steps (its data loader yielded no full batch): lower its "
            "batch size or train on more examples; no checkpoint was saved"
        )
    records = write_metrics(trainer.state.log_history, out_dir / "metrics.jsonl", extra=extra)
    masked_steps(records, trainer.args, stage)
    # the train extra: imported only where used
    from safetensors import SafetensorError

    staging = out_dir / ".checkpoint.partial"
    if staging.exists():  # what an interrupted save left
        shutil.rmtree(staging)
    try:
        save_checkpoint(
            trainer.model, trainer.processing_class, staging, args=trainer.args, prompt=prompt
        )
        return commit_folder(staging, out_dir / "checkpoint")
    except (OSError, SafetensorError) as exc:  # a full disk: safetensors says so its own way
        shutil.rmtree(staging, ignore_errors=True)
        raise OutputWriteError(
            f"cannot write the checkpoint of {stage} in {out_dir} ({exc}); the stages before it "
            "are kept: make room and run the same command to resume"
        ) from exc


#: TRL's log entry of the smallest importance-sampling ratio of a step (vLLM generation only).
IS_RATIO_MIN = "sampling/importance_sampling_ratio/min"


def masked_steps(records: list[dict[str, Any]], settings: Any, name: str) -> list[int]:
    """Steps where TRL's importance-sampling mask zeroed a sequence or a token, with a warning.

    Under a ``*_mask`` mode a ratio past the clip becomes 0 (``IS_RATIO_MIN`` of the step is 0):
    that sequence or token is not trained on. ``records`` are ``metrics.jsonl``'s; ``settings``
    the stage's ``GRPOConfig`` or stage configuration (anything without vLLM: no correction).
    """
    if not getattr(settings, "use_vllm", False):
        return []
    mode = settings.vllm_importance_sampling_mode
    if not mode.endswith("_mask"):
        return []
    steps = [r.get("step", i) for i, r in enumerate(records) if r.get(IS_RATIO_MIN) == 0]
    if steps:
        logger.warning(
            "%s: TRL's importance-sampling mask (%s, clip %s) dropped part of the batch from the "
            "loss at %d of %d steps (%s = 0); %s.vllm_importance_sampling_mode=token_truncate "
            "clips instead of dropping",
            name,
            mode,
            settings.vllm_importance_sampling_clip_max,
            len(steps),
            sum(1 for r in records if IS_RATIO_MIN in r),
            IS_RATIO_MIN,
            name,
        )
    return steps


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


def save_checkpoint(
    model: Any, tokenizer: Any, path: Path, *, args: Any = None, prompt: Any = None
) -> Path:
    """Save a full checkpoint of ``model`` (LoRA adapters merged in) and its tokenizer at ``path``.

    With the trainer's ``args`` in mixed precision, the weights are saved in its half dtype (what
    the next stage and vLLM load anyway), not in the float32 of the master weights. ``prompt``
    (:class:`birdenv.schema.PromptOptions`), the setting the model was trained on, is recorded
    beside them (:func:`birdtrain.prompts.record_prompt`) for evaluations to read it the same way.
    """
    # A peft model saves adapters only; later stages and evaluation load a plain checkpoint.
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    if args is not None and (args.bf16 or args.fp16):
        # the train extra: imported only where used
        import torch

        model = model.to(torch.bfloat16 if args.bf16 else torch.float16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if prompt is not None:
        record_prompt(path, prompt)
    return path

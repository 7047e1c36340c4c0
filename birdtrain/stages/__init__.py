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

__all__ = ["save_checkpoint", "silence_trl_experimental", "trainer_device_args", "write_metrics"]


def trainer_device_args(dtype: str) -> dict[str, Any]:
    """``TrainingArguments`` keywords for this machine: CPU when there is no CUDA, bf16/fp16 on GPU."""
    import torch

    if not torch.cuda.is_available():
        return {"use_cpu": True, "bf16": False, "fp16": False}
    return {"bf16": dtype == "bfloat16", "fp16": dtype == "float16"}


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

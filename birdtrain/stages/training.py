"""Driving a stage's trainer: the batches it can train, the actor it samples with, its resumed run."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from birdenv.errors import BirdEnvError
from birdtrain import policies
from birdtrain.stages import weight_sync

__all__ = [
    "StageError",
    "check_batches",
    "colocated_kv_cache",
    "prompt_groups",
    "silence_trl_experimental",
    "stage_actor",
    "train",
]


class StageError(BirdEnvError, ValueError):
    """A stage cannot train as configured (the message names the setting to change)."""


@contextlib.contextmanager
def colocated_kv_cache(args: Any, model_path: str, *, contexts: int) -> Iterator[None]:
    """While a GRPO trainer is built with ``args`` on a CPU, its colocated vLLM engine gets a KV
    cache sized for ``contexts`` sequences of its whole window (``VLLM_CPU_KVCACHE_SPACE``, in
    GiB, unless the environment already sets it).

    On a CPU, vLLM takes ``vllm_gpu_memory_utilization`` of the machine's memory less what its
    process already holds, which here includes the model being trained: a 1.5B model left no
    room at 0.2 and the engine refused to start. On a GPU the share is the card's, as TRL means.
    """
    # the train extra: imported only where used
    import torch
    from transformers import AutoConfig

    if (
        not args.use_vllm
        or args.vllm_mode != "colocate"
        or torch.cuda.is_available()
        or "VLLM_CPU_KVCACHE_SPACE" in os.environ
    ):
        yield
        return
    config = AutoConfig.from_pretrained(model_path)
    dtype = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    size = policies.kv_cache_bytes(
        config.get_text_config(), contexts=contexts, window=args.vllm_max_model_length, dtype=dtype
    )
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(size / 2**30)))
    try:
        yield
    finally:
        del os.environ["VLLM_CPU_KVCACHE_SPACE"]  # an evaluation's engine sizes its own


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


def stage_actor(trainer: Any, policy: Any = None) -> Any:
    """The sampler of a GRPO stage's rollouts: ``policy(trainer)`` when given (scripted actors,
    tests), else the trainer's vLLM engine (a GRPO trainer's ``args.use_vllm``) or the trained
    model."""

    if policy is not None:
        return policy(trainer)
    if getattr(trainer.args, "use_vllm", False):  # an SFT trainer has no vLLM
        return policies.VLLMPolicy(trainer)
    model = trainer.accelerator.unwrap_model(trainer.model)
    # Sampled under the autocast the trainer scores under, so a rollout's logprobs are the ones
    # the loss treats as on-policy.
    dtype = "bfloat16" if trainer.args.bf16 else "float16" if trainer.args.fp16 else "float32"
    return policies.TransformersPolicy(model, trainer.processing_class, dtype=dtype)


def _last_complete_checkpoint(folder: Path) -> str | None:
    """The newest intermediate checkpoint (``checkpoint-N``) in a trainer's output ``folder`` that
    was written to its end, or None.

    The Trainer writes a checkpoint's ``trainer_state.json`` last: a process killed while saving
    leaves a folder without it (or with it cut short), and resuming from that folder fails. Such a
    folder is passed over with a line saying so, and the next save of its step writes over it.
    """
    # The Trainer's own names for its checkpoint folders and its state file; the caller's
    # trainer has already imported both modules.
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    pattern = re.compile(rf"{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)")
    steps = sorted(
        (
            (int(match.group(1)), path)
            for path in folder.iterdir()
            if path.is_dir() and (match := pattern.fullmatch(path.name))
        ),
        reverse=True,
    )
    for _, path in steps:
        try:
            json.loads((path / TRAINER_STATE_NAME).read_text())
        except (OSError, ValueError):
            print(f"{path} was not written to its end (a save interrupted): passed over")
            continue
        return str(path)
    return None


def train(trainer: Any) -> None:
    """``trainer.train()``, resumed from the newest intermediate checkpoint in the trainer's
    output folder when an earlier, interrupted run left one, and quiet unless transformers logs
    more than errors (``birdtrain -v``): no progress bar and no printed line per logging step (the
    steps' metrics still reach ``metrics.jsonl``).

    The model, optimizer, schedule, RNG states, step count and log history come back; the data
    loader skips the batches already trained on. A stage's own sampling state (dynamic
    sampling's replacement draws) starts afresh.
    """
    weight_sync.install(trainer)  # LoRA merged out of place for vLLM: the base stays untouched
    out = Path(trainer.args.output_dir)
    last = _last_complete_checkpoint(out) if out.is_dir() else None
    if last is not None:
        print(f"resuming from {last}")
    _quiet_steps(trainer)
    with warnings.catch_warnings():
        # TRL 1.16's GRPO wraps each generation in its disable_gradient_checkpointing, which calls
        # transformers' old gradient_checkpointing_* names (deprecated from 5.24) whether or not
        # checkpointing is on; the stages themselves use the installed release's name
        # (checkpointing_keyword).
        warnings.filterwarnings(
            "ignore",
            message=r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated",
            category=FutureWarning,
        )
        trainer.train(resume_from_checkpoint=last)


def _quiet_steps(trainer: Any) -> None:
    """Drop the trainer's progress bar and its printed line per logging step when transformers logs
    errors only (``birdtrain`` without ``-v``)."""
    # the train extra: imported only where used
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging

    if logging.get_verbosity() > logging.WARNING:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)


def silence_trl_experimental() -> None:
    """TRL warns on every import of its experimental parts; we use them on purpose."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

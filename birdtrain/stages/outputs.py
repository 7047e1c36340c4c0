"""What a stage leaves behind: its metrics, the importance-mask warning and the merged checkpoint."""

from __future__ import annotations

import copy
import itertools
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from birdtrain.errors import OutputWriteError
from birdtrain.prompts import record_prompt
from birdtrain.rundir import commit_folder
from birdtrain.stages.training import StageError

logger = logging.getLogger(__name__)

__all__ = [
    "IS_RATIO_MIN",
    "SHARD_BYTES",
    "finish_stage",
    "masked_steps",
    "save_checkpoint",
    "save_merged",
    "write_metrics",
]


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
    # the train extra: imported only where used
    import torch
    from peft import PeftModel

    half = None
    if args is not None and (args.bf16 or args.fp16):
        half = torch.bfloat16 if args.bf16 else torch.float16
    if isinstance(model, PeftModel):
        # A peft model saves adapters only; later stages and evaluation load a plain checkpoint.
        save_merged(model, path, dtype=half)
    else:
        (model if half is None else model.to(half)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    if prompt is not None:
        record_prompt(path, prompt)
    return path


#: The most bytes of merged weights :func:`save_merged` holds at once (one shard's).
SHARD_BYTES = 2**30


def save_merged(
    model: Any, path: Path, *, dtype: Any = None, shard_bytes: int = SHARD_BYTES
) -> None:
    """Write the PEFT ``model`` with its LoRA adapters merged as a plain ``transformers``
    checkpoint at ``path`` (config, generation config, safetensors shards of at most
    ``shard_bytes`` and their index), in ``dtype`` (a torch dtype; None: as trained).

    The merge is out of place and streamed a shard at a time
    (:func:`birdtrain.stages.weight_sync.merged_named_params`); the model is only read. peft's
    ``merge_and_unload`` would write every adapted weight in place: where the frozen base is a
    private mapping of its checkpoint file (``transformers`` 5 loads it so), that turns the
    mapped pages of a 1.5B model into 5 GB of anonymous memory, at the end of a stage 4 whose
    colocated vLLM engine still holds its own copy of the model.
    """
    # the train extra: imported only where used
    from safetensors.torch import save_file

    from birdtrain.stages.weight_sync import checkpoint_name, merged_named_params

    base = model.get_base_model()
    path.mkdir(parents=True, exist_ok=True)
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = (  # persistent buffers: in a checkpoint, like the weights
        (checkpoint_name(name, model.prefix), tensor)
        for name, tensor in model.state_dict().items()
        if name not in parameters
    )
    tensors = itertools.chain(merged_named_params(model, rename=lambda name: name), buffers)
    shards: list[list[str]] = []
    shard: dict[str, Any] = {}
    shard_size = total = 0
    saved_dtype = None
    for name, tensor in tensors:
        if name is None:
            continue
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        saved_dtype = saved_dtype or (tensor.dtype if tensor.is_floating_point() else None)
        if shard and shard_size + tensor.nbytes > shard_bytes:
            save_file(shard, path / f"model-{len(shards) + 1:05d}.safetensors", {"format": "pt"})
            shards.append(list(shard))
            shard, shard_size = {}, 0
        shard[name] = tensor.contiguous()
        shard_size += tensor.nbytes
        total += tensor.nbytes
    save_file(shard, path / f"model-{len(shards) + 1:05d}.safetensors", {"format": "pt"})
    shards.append(list(shard))
    if len(shards) == 1:
        os.replace(path / "model-00001.safetensors", path / "model.safetensors")
    else:
        weight_map = {}
        for number, names in enumerate(shards, start=1):
            file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            os.replace(path / f"model-{number:05d}.safetensors", path / file)
            weight_map |= dict.fromkeys(names, file)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = copy.deepcopy(base.config)
    # as save_pretrained records them: the weights' dtype, and the class that loads them
    config.dtype = str(saved_dtype or base.dtype).removeprefix("torch.")
    config.architectures = [type(base).__name__]
    config.save_pretrained(path)
    if base.can_generate() and base.generation_config is not None:
        base.generation_config.save_pretrained(path)

"""The trainer keywords the stages build from the configuration (``TrainingArguments``, ``GRPOConfig``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from birdtrain.config import CurriculumConfig, GRPOSettings, SFTStageConfig
from birdtrain.policies import SAMPLING, uses_vllm
from birdtrain.stages.precision import Precision

__all__ = [
    "checkpointing",
    "checkpointing_keyword",
    "common_arguments",
    "grpo_arguments",
    "trainer_device_args",
]


def checkpointing(save_steps: int) -> dict[str, Any]:
    """``TrainingArguments`` keywords for a stage's intermediate checkpoints (``save_steps``, 0:
    none; the final, merged save is :func:`save_checkpoint`'s). Only the newest is kept: it holds
    the optimizer state, several times the model's size."""
    if not save_steps:
        return {"save_strategy": "no"}
    return {"save_strategy": "steps", "save_steps": save_steps, "save_total_limit": 1}


def common_arguments(cfg: CurriculumConfig, stage: SFTStageConfig | GRPOSettings) -> dict[str, Any]:
    """``TrainingArguments`` keywords every stage shares: a log entry per step, the run's seed and
    reporting, and the stage's intermediate checkpoints (:func:`checkpointing`; the final, merged
    save is :func:`save_checkpoint`'s). ``stage``: the stage's configuration."""
    return {
        "logging_steps": 1,
        "report_to": cfg.report_to,
        "seed": cfg.seed,
        "disable_tqdm": False,
        **checkpointing(stage.save_steps),
    }


@functools.cache
def checkpointing_keyword() -> str:
    """``TrainingArguments``' name for gradient checkpointing in the installed transformers:
    ``activation_checkpointing`` from 5.24 on (where the old name is a deprecated alias that
    warns), ``gradient_checkpointing`` before (5.17, the release vLLM 0.31 caps a GPU install
    at, has no other)."""
    # the train extra: imported only where used
    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    return (
        "activation_checkpointing"
        if "activation_checkpointing" in fields
        else "gradient_checkpointing"
    )


def trainer_device_args(precision: Precision, model: Any) -> dict[str, Any]:
    """``TrainingArguments`` keywords for ``precision`` and the ``model`` settings
    (:class:`~birdtrain.config.ModelConfig`): CPU without CUDA, autocast where ``precision``
    computes in half precision, and ``model.gradient_checkpointing``."""
    # TRL turns checkpointing on by default; pass it either way, by the installed release's name.
    args: dict[str, Any] = {checkpointing_keyword(): model.gradient_checkpointing}
    if not precision.cuda:
        # CPU autocast is bfloat16 only (float16 on a CPU stores a LoRA base, nothing more).
        return {**args, "use_cpu": True, "bf16": precision.compute == "bfloat16", "fp16": False}
    return {
        **args,
        "bf16": precision.compute == "bfloat16",
        "fp16": precision.compute == "float16",
    }


def _reference_arguments(precision: Precision, *, beta: float) -> dict[str, Any]:
    """``GRPOConfig`` keywords for the reference model of full fine-tuning.

    TRL builds it in the policy's dtype, float32 here; it never trains, so it is stored in the
    compute dtype (half the memory). Under LoRA the base with adapters off is the reference.
    """
    if beta == 0 or precision.lora or not precision.half:
        return {}
    return {"model_init_kwargs": {"dtype": precision.compute}}


def _vllm_arguments(
    stage: GRPOSettings, model_path: str, *, max_model_length: int
) -> dict[str, Any]:
    """``GRPOConfig`` keywords for generation: :data:`~birdtrain.policies.SAMPLING`, and vLLM's
    settings when on (``stage.use_vllm`` for ``model_path``, :func:`~birdtrain.policies.uses_vllm`:
    the stage's input checkpoint has the base model's architecture).

    ``max_model_length``: the longest sequence the stage produces, vLLM's context window unless
    ``stage.vllm_max_model_length`` sets one.
    """

    use_vllm = uses_vllm(stage.use_vllm, model_path)
    args: dict[str, Any] = {**SAMPLING, "use_vllm": use_vllm}
    if not use_vllm:
        return args
    args.update(
        vllm_mode=stage.vllm_mode,
        vllm_max_model_length=stage.vllm_max_model_length or max_model_length,
        vllm_importance_sampling_mode=stage.vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_max=stage.vllm_importance_sampling_clip_max,
    )
    if stage.vllm_mode == "colocate":
        args.update(
            vllm_gpu_memory_utilization=stage.vllm_gpu_memory_utilization,
            vllm_enable_sleep_mode=stage.vllm_enable_sleep_mode,
        )
    elif stage.vllm_server_base_url:
        args["vllm_server_base_url"] = stage.vllm_server_base_url
    return args


def grpo_arguments(
    cfg: CurriculumConfig,
    stage: GRPOSettings,
    precision: Precision,
    *,
    sequences: int,
    max_model_length: int,
) -> dict[str, Any]:
    """The ``GRPOConfig`` keywords stages 3 and 4 share (``stage``: ``cfg.stage3`` or ``stage4``).

    TRL generates a step's ``sequences`` (prompts x group) together, then trains on them in
    micro-batches of ``stage.micro_batch_size`` (one group by default) whose gradients
    accumulate: memory grows with the micro-batch, not with the step. ``max_model_length``: the
    longest sequence the stage produces (vLLM's context window unless the stage sets one).
    """
    micro = stage.micro_batch_size or stage.num_generations
    return {
        "num_generations": stage.num_generations,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": sequences // micro,
        "max_steps": stage.max_steps,
        "learning_rate": stage.learning_rate,
        "beta": stage.beta,
        "temperature": stage.temperature,
        **common_arguments(cfg, stage),
        **_vllm_arguments(stage, cfg.model.name_or_path, max_model_length=max_model_length),
        **_reference_arguments(precision, beta=stage.beta),
        **trainer_device_args(precision, cfg.model),
    }

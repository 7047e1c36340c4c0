"""Loading a stage's model for training: one GPU, the dtype rule applied."""

from __future__ import annotations

import os
from typing import Any

from birdtrain.config import CurriculumConfig
from birdtrain.errors import GPUSetupError
from birdtrain.models import load_policy, lora_config
from birdtrain.stages.precision import Precision, training_precision

__all__ = ["check_single_gpu", "load_for_training"]


def check_single_gpu() -> None:
    """Refuse several visible GPUs in a process no launcher started.

    ``Trainer`` would wrap the model in ``nn.DataParallel``, which GRPO rejects and which the
    per-turn rollout loop of stage 4 cannot drive; data parallelism needs one process per GPU.
    """
    # the train extra: imported only where used
    import torch

    if not torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    count = torch.cuda.device_count()
    if count > 1:
        raise GPUSetupError(
            f"{count} GPUs are visible and birdtrain trains on one: make one visible with "
            "CUDA_VISIBLE_DEVICES=0 (one process per GPU, e.g. under `accelerate launch`, is the "
            "way to train on several; birdtrain does not start them)"
        )


def load_for_training(cfg: CurriculumConfig, model_path: str) -> tuple[Any, Any, Any, Precision]:
    """``(model, tokenizer, peft_config, precision)`` of a training stage, the dtype rule applied.

    The model is loaded in its checkpoint's dtype, LoRA decided (``model.lora``; ``None``: over
    1B parameters), then cast to :attr:`Precision.weights`.
    """
    # the train extra: imported only where used
    import torch

    check_single_gpu()
    model, tokenizer = load_policy(model_path, dtype="auto")
    peft_config = lora_config(cfg.model, model)
    precision = training_precision(cfg.model.dtype, lora=peft_config is not None)
    model = model.to(getattr(torch, precision.weights))
    return model, tokenizer, peft_config, precision

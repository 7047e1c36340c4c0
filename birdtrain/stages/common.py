"""What the curriculum's stages share: precision, trainer arguments, checkpoints and metrics."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from birdenv.errors import GPUSetupError, OutputWriteError
from birdtrain.config import CurriculumConfig, GRPOSettings, SFTStageConfig
from birdtrain.rundir import commit_folder

logger = logging.getLogger(__name__)

__all__ = [
    "IS_RATIO_MIN",
    "Precision",
    "StageError",
    "check_batches",
    "check_single_gpu",
    "checkpointing",
    "checkpointing_keyword",
    "common_arguments",
    "dtype_bytes",
    "finish_stage",
    "grpo_arguments",
    "load_for_training",
    "masked_steps",
    "prompt_groups",
    "save_checkpoint",
    "silence_trl_experimental",
    "stage_actor",
    "train",
    "trainer_device_args",
    "training_precision",
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


def stage_actor(trainer: Any, policy: Any = None) -> Any:
    """The sampler of a GRPO stage's rollouts: ``policy(trainer)`` when given (scripted actors,
    tests), else the trainer's vLLM engine (a GRPO trainer's ``args.use_vllm``) or the trained
    model."""
    from birdtrain import policies

    if policy is not None:
        return policy(trainer)
    if getattr(trainer.args, "use_vllm", False):  # an SFT trainer has no vLLM
        return policies.VLLMPolicy(trainer)
    model = trainer.accelerator.unwrap_model(trainer.model)
    # Sampled under the autocast the trainer scores under, so a rollout's logprobs are the ones
    # the loss treats as on-policy.
    dtype = "bfloat16" if trainer.args.bf16 else "float16" if trainer.args.fp16 else "float32"
    return policies.TransformersPolicy(model, trainer.processing_class, dtype=dtype)


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

    from birdtrain.stages import weight_sync

    weight_sync.install(trainer)  # LoRA merged out of place for vLLM: the base stays untouched
    out = Path(trainer.args.output_dir)
    last = get_last_checkpoint(str(out)) if out.is_dir() else None
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
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging

    if logging.get_verbosity() > logging.WARNING:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)


@dataclasses.dataclass(frozen=True)
class Precision:
    """How a stage holds and computes its model: the one dtype rule of every training stage.

    Trainable weights are always float32 (full fine-tuning keeps float32 master weights; LoRA
    adapters are float32), so no stage trains in pure half precision by accident: Adam's small
    steps would round away in bfloat16, and float16 gradients cannot be unscaled. The forward and
    backward run in ``compute`` under autocast (on a GPU, or on a CPU with native bfloat16
    instructions); frozen weights (the LoRA base) and the reference model are stored in it.
    """

    #: dtype the model is loaded and kept in: float32 for full fine-tuning, ``compute`` for a LoRA base.
    weights: str
    #: dtype of the forward and backward (autocast where it is not float32).
    compute: str
    cuda: bool
    #: trains LoRA adapters (float32) on a frozen base, rather than every weight.
    lora: bool

    @property
    def half(self) -> bool:
        """True when the forward runs in bfloat16 or float16 (autocast)."""
        return self.compute != "float32"


_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``"float32"``, ``"bfloat16"`` or ``"float16"``."""
    return _BYTES[dtype]


def cpu_bf16_supported() -> bool:
    """True when this CPU computes bfloat16 natively (AVX512-BF16 or AMX), where autocast runs a
    matrix product several times faster than float32; elsewhere bfloat16 is emulated, and slower."""
    import torch

    return bool(
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def training_precision(
    dtype: str, *, lora: bool, cuda: bool | None = None, bf16_supported: bool | None = None
) -> Precision:
    """The :class:`Precision` of a stage from ``model.dtype`` and whether it trains LoRA adapters.

    ``dtype="auto"`` is bfloat16 on a GPU that supports it, float16 on one that does not, float32
    on the CPU. On a CPU, ``"bfloat16"`` computes under CPU autocast where the CPU has native
    bfloat16 instructions (:func:`cpu_bf16_supported`); on one without them, and for
    ``"float16"``, full fine-tuning computes in float32 and a half ``dtype`` only stores (and
    runs) a frozen LoRA base in it. ``cuda`` and ``bf16_supported`` (the GPU's, or without CUDA
    the CPU's) default to this machine's.
    """
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    if bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported() if cuda else cpu_bf16_supported()
    if dtype == "auto":
        # float32 on every CPU unless asked: a CPU run computes the same on any CPU.
        dtype = ("bfloat16" if bf16_supported else "float16") if cuda else "float32"
    native = cuda or (dtype == "bfloat16" and bf16_supported)
    compute = dtype if native or lora else "float32"
    return Precision(weights=dtype if lora else "float32", compute=compute, cuda=cuda, lora=lora)


def sampling_dtype(model: Any) -> str:
    """What a policy computes in when it samples outside a stage (evaluations, difficulty
    estimates): the compute dtype full fine-tuning with ``model`` settings
    (:class:`~birdtrain.config.ModelConfig`) trains and samples under, so the figures are the
    policy's as its own rollouts saw it."""
    return training_precision(model.dtype, lora=False).compute


def check_single_gpu() -> None:
    """Refuse several visible GPUs in a process no launcher started.

    ``Trainer`` would wrap the model in ``nn.DataParallel``, which GRPO rejects and which the
    per-turn rollout loop of stage 4 cannot drive; data parallelism needs one process per GPU.
    """
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
    from birdtrain.policies import SAMPLING, uses_vllm

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


def load_for_training(cfg: CurriculumConfig, model_path: str) -> tuple[Any, Any, Any, Precision]:
    """``(model, tokenizer, peft_config, precision)`` of a training stage, the dtype rule applied.

    The model is loaded in its checkpoint's dtype, LoRA decided (``model.lora``; ``None``: over
    1B parameters), then cast to :attr:`Precision.weights`.
    """
    import torch

    from birdtrain.models import load_policy, lora_config

    check_single_gpu()
    model, tokenizer = load_policy(model_path, dtype="auto")
    peft_config = lora_config(cfg.model, model)
    precision = training_precision(cfg.model.dtype, lora=peft_config is not None)
    model = model.to(getattr(torch, precision.weights))
    return model, tokenizer, peft_config, precision


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
        import torch

        model = model.to(torch.bfloat16 if args.bf16 else torch.float16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if prompt is not None:
        from birdtrain.prompts import record_prompt

        record_prompt(path, prompt)
    return path


def silence_trl_experimental() -> None:
    """TRL warns on every import of its experimental parts; we use them on purpose."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

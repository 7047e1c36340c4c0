"""Stage 3, reasoning RL: single-turn GRPO with TRL's ``GRPOTrainer``, rewarded by the judge.

Each training task becomes one conversational prompt (:func:`birdtrain.prompts.single_turn_prompt`)
plus its ``task_id``; TRL samples ``num_generations`` answers per prompt and scores each with
:func:`birdtrain.rewards.solution_reward` (the official judge's verdict on the ``<solution>``),
plus ``format_reward_weight`` × :func:`birdtrain.rewards.format_reward` through TRL's
``reward_weights``. Advantages are relative to the group, as GRPO defines them. A task mixture
(``data.mixture``) may hold BIRD questions: their prompt is the BIRD single-turn prompt and the
same reward function scores them by execution accuracy (:func:`birdtrain.rewards.score_submission`).

One optimizer step sees ``prompts_per_step`` prompts × ``num_generations`` completions: a
micro-batch is one prompt's group and gradients accumulate over the prompts, so memory grows with
the group, not with the whole batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from birdenv.bird import BirdTask
from birdenv.tasks import Task
from birdtrain.stages import save_checkpoint, trainer_device_args, write_metrics

__all__ = ["build_dataset", "build_trainer", "run", "step_metrics"]

logger = logging.getLogger(__name__)


def build_dataset(
    tasks: Iterable[Task | BirdTask], tokenizer: Any, max_prompt_length: int | None
) -> Any:
    """The GRPO dataset: ``prompt`` (one user message) and ``task_id`` per task.

    TRL 1.16's GRPO has no prompt-length setting, and cutting a prompt would cut its schema or
    its issue; prompts longer than ``max_prompt_length`` tokens are left out instead, with a
    warning, and none left is an error.
    """
    from datasets import Dataset

    from birdtrain.prompts import single_turn_prompt

    rows, dropped = [], []
    for task in tasks:
        prompt = [{"role": "user", "content": single_turn_prompt(task)}]
        if max_prompt_length is not None:
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            if len(tokenizer(text, add_special_tokens=False).input_ids) > max_prompt_length:
                dropped.append(task.instance_id)
                continue
        rows.append({"prompt": prompt, "task_id": task.instance_id})
    if dropped:
        logger.warning(
            "stage 3: %d of %d prompts exceed stage3.max_prompt_length=%s tokens and are left out: %s",
            len(dropped),
            len(dropped) + len(rows),
            max_prompt_length,
            ", ".join(dropped[:10]),
        )
    if not rows:
        raise ValueError(
            f"stage 3: every prompt is longer than stage3.max_prompt_length={max_prompt_length} "
            "tokens; raise it"
        )
    return Dataset.from_list(rows)


def build_trainer(
    cfg: Any, *, model_path: str, out_dir: Path, tasks: Iterable[Task | BirdTask]
) -> Any:
    """The configured ``GRPOTrainer`` (what :func:`run` trains)."""
    from trl import GRPOConfig, GRPOTrainer

    from birdtrain.models import load_policy, lora_config
    from birdtrain.rewards import format_reward, register_tasks, solution_reward

    s = cfg.stage3
    tasks = list(tasks)
    # TRL hands reward functions dataset columns only: the judge finds each Task by its task_id.
    register_tasks(tasks)
    model, tokenizer = load_policy(model_path, dtype=cfg.model.dtype)
    dataset = build_dataset(tasks, tokenizer, s.max_prompt_length)
    reward_funcs: list[Any] = [solution_reward]
    reward_weights = [1.0]
    if s.format_reward_weight:
        reward_funcs.append(format_reward)
        reward_weights.append(s.format_reward_weight)
    vllm = {"use_vllm": True, "vllm_mode": "colocate"} if s.use_vllm else {}
    args = GRPOConfig(
        output_dir=str(Path(out_dir) / "trainer"),
        max_steps=s.max_steps,
        learning_rate=s.learning_rate,
        beta=s.beta,
        temperature=s.temperature,
        num_generations=s.num_generations,
        max_completion_length=s.max_completion_length,
        # One prompt's group per micro-batch, accumulated over the step's prompts.
        per_device_train_batch_size=s.num_generations,
        gradient_accumulation_steps=s.prompts_per_step,
        reward_weights=reward_weights,
        logging_steps=1,
        save_strategy="no",  # the final, merged save is ours
        report_to=cfg.report_to,
        seed=cfg.seed,
        disable_tqdm=False,
        **vllm,
        **trainer_device_args(cfg.model.dtype),
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(cfg.model, model),
    )


def step_metrics(entry: dict[str, Any]) -> dict[str, Any]:
    """Stage 3's own names for a log entry: ``reward_mean``, ``reward_std``, ``pass_rate``.

    ``pass_rate`` is the mean of the (binary) solution reward: the fraction of the step's
    completions the judge accepted.
    """
    if "reward" not in entry:
        return {}
    return {
        "reward_mean": entry["reward"],
        "reward_std": entry.get("reward_std"),
        "pass_rate": entry.get("rewards/solution_reward/mean"),
    }


def run(cfg: Any, *, model_path: str, out_dir: Path, tasks: Iterable[Task | BirdTask]) -> Path:
    """Train stage 3 from ``model_path`` on ``tasks``; return the checkpoint path.

    Writes ``out_dir/metrics.jsonl`` (per step: ``step``, ``loss``, ``learning_rate``,
    ``reward_mean``, ``reward_std``, ``pass_rate``, ``rewards/format_reward/mean``, ``kl``,
    completion lengths…, then the trainer's summary) and the merged checkpoint with its tokenizer
    at ``out_dir/"checkpoint"``.
    """
    out_dir = Path(out_dir)
    trainer = build_trainer(cfg, model_path=model_path, out_dir=out_dir, tasks=tasks)
    trainer.train()
    write_metrics(trainer.state.log_history, out_dir / "metrics.jsonl", extra=step_metrics)
    return save_checkpoint(trainer.model, trainer.processing_class, out_dir / "checkpoint")

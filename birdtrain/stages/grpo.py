"""Stage 3, reasoning RL: single-turn GRPO with TRL's ``GRPOTrainer``, rewarded by the judge.

Each training task becomes one prompt (:func:`birdtrain.prompts.single_turn_prompt`, in the run's
prompt setting). Every step takes ``prompts_per_step`` tasks and samples ``num_generations``
answers for each (the GRPO group); an answer scores :func:`birdtrain.rewards.solution_reward`
(the official judge's verdict on its ``<solution>``, or execution accuracy for a BIRD question)
plus ``format_reward_weight`` × :func:`birdtrain.rewards.format_reward`.

Generation goes through TRL's ``rollout_func`` hook, as in stage 4, because the step's batch is
ours to choose: with ``dynamic_sampling_rounds > 0`` a group whose rewards are all equal (no
advantage, nothing learnt) is replaced by the group of another training task
(:func:`birdtrain.sampling.dynamic_sample`). Rewards are computed while sampling and handed to
TRL as extra fields; TRL's reward functions only read them back, so TRL's logs
(``rewards/solution_reward/mean``, ``frac_reward_zero_std``) describe the batch it trains on.

One optimizer step sees ``prompts_per_step`` × ``num_generations`` completions, trained on in
micro-batches (``micro_batch_size``; one prompt's group by default) whose gradients accumulate, so
memory grows with the micro-batch, not with the whole batch.

Read top to bottom: dataset (one row per task) → ``rollout_func`` (sample, score, resample) →
reward functions (read the scores, log the sampling figures) → ``GRPOConfig`` → train → save.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from birdtrain.config import CurriculumConfig, GRPOStageConfig
from birdtrain.prompts import single_turn_prompt
from birdtrain.rewards import format_reward, score_text
from birdtrain.sampling import Group
from birdtrain.stages.arguments import grpo_arguments
from birdtrain.stages.grpo_step import Generate, StepColumns, rollout_function
from birdtrain.stages.loading import load_for_training
from birdtrain.stages.outputs import finish_stage
from birdtrain.stages.precision import Precision
from birdtrain.stages.shared_prompt import grpo_trainer_class
from birdtrain.stages.training import (
    check_batches,
    colocated_kv_cache,
    silence_trl_experimental,
    train,
)

__all__ = [
    "build_dataset",
    "build_trainer",
    "make_rollout_func",
    "run",
    "step_metrics",
    "trainer_arguments",
]

logger = logging.getLogger(__name__)

# Answers generated per policy call: bounds the KV cache on small machines.
_GENERATION_CHUNK = 32


def _prompt_messages(task: Any, prompt: Any) -> list[dict[str, str]]:

    return [{"role": "user", "content": single_turn_prompt(task, prompt)}]


def _prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def build_dataset(
    tasks: Iterable[Any], tokenizer: Any, max_prompt_length: int | None, prompt: Any = None
) -> Any:
    """The GRPO dataset: one row per task, ``prompt`` (a user message naming it) and ``task_id``.

    The rollout function renders the real prompt (``prompt``: the run's prompt setting). TRL
    1.16's GRPO has no prompt-length setting, and cutting a prompt would cut its schema or its
    issue; tasks whose prompt is longer than ``max_prompt_length`` tokens are left out instead,
    with a warning, and none left is an error.
    """
    # the train extra: imported only where used
    from datasets import Dataset

    rows, dropped = [], []
    for task in tasks:
        messages = _prompt_messages(task, prompt)
        if (
            max_prompt_length is not None
            and len(_prompt_ids(tokenizer, messages)) > max_prompt_length
        ):
            dropped.append(task.instance_id)
            continue
        rows.append(
            {"prompt": [{"role": "user", "content": task.instance_id}], "task_id": task.instance_id}
        )
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
            "tokens; raise it, or use shorter prompts (prompt.schema=linked)"
        )
    return Dataset.from_list(rows)


def make_rollout_func(
    tasks: Sequence[Any],
    stage: GRPOStageConfig,
    *,
    prompt: Any = None,
    seed: int = 0,
    policy: Any = None,
    groups_path: Path | None = None,
) -> Any:
    """TRL's ``rollout_func(prompts, trainer)`` for stage 3: sample, score, resample.

    ``tasks`` are the tasks the dataset names and replacements are drawn from. ``policy(trainer)
    -> Policy`` replaces the trained model as the sampler (tests); by default the trainer's model
    samples (vLLM when ``stage.use_vllm``). With ``groups_path`` each step's own draw is appended
    there (:func:`birdtrain.sampling.record_groups`).
    """

    by_id = {t.instance_id: t for t in tasks}
    contexts: dict[str, list[int]] = {}

    def begin(trainer: Any, actor: Any, group: int) -> tuple[Generate, StepColumns]:
        tokenizer = trainer.processing_class

        def context(task_id: str) -> list[int]:
            if task_id not in contexts:
                contexts[task_id] = _prompt_ids(tokenizer, _prompt_messages(by_id[task_id], prompt))
            return contexts[task_id]

        def generate(ids: list[str]) -> list[Group]:
            jobs = [t for t in ids for _ in range(group)]
            samples: list[tuple[list[int], list[float]]] = []
            for i in range(0, len(jobs), _GENERATION_CHUNK):
                samples += actor.generate(
                    [context(t) for t in jobs[i : i + _GENERATION_CHUNK]],
                    max_new_tokens=stage.max_completion_length,
                    temperature=stage.temperature,
                )
            groups = []
            for k, task_id in enumerate(ids):
                items = []
                for completion, logprobs in samples[k * group : (k + 1) * group]:
                    text = tokenizer.decode(completion, skip_special_tokens=True)
                    solution = score_text(by_id[task_id], text)
                    fmt = format_reward(None, [text])[0]
                    items.append((context(task_id), completion, logprobs, solution, fmt))
                rewards = [s + stage.format_reward_weight * f for *_, s, f in items]
                groups.append(Group(task_id, rewards, items))
            return groups

        def columns(batch: list[Group]) -> dict[str, list[Any]]:
            eos = tokenizer.eos_token_id
            rows = [item for g in batch for item in g.items]
            return {
                "prompt_ids": [r[0] for r in rows],
                "completion_ids": [r[1] or [eos] for r in rows],
                "logprobs": [r[2] or [0.0] for r in rows],
                "solution_score": [r[3] for r in rows],
                "format_score": [r[4] for r in rows],
            }

        return generate, columns

    return rollout_function(
        stage, begin, policy=policy, pool=list(by_id), seed=seed, groups_path=groups_path
    )


def _solution_reward(
    prompts: list[Any], completions: list[Any], solution_score: list[float], **kwargs: Any
) -> list[float | None]:
    """The judge's verdict on each completion, scored while sampling (see ``rollout_func``)."""
    log_metric = kwargs.get("log_metric")
    if log_metric is not None:
        for name, value in kwargs["sampling_stats"][0].items():
            log_metric(name, value)
    return list(solution_score)


def _format_reward(
    prompts: list[Any], completions: list[Any], format_score: list[float], **kwargs: Any
) -> list[float | None]:
    """The format reward of each completion, scored while sampling."""
    return list(format_score)


# TRL names its logged reward columns after the functions: keep the names of birdtrain.rewards.
_solution_reward.__name__ = "solution_reward"
_format_reward.__name__ = "format_reward"


def trainer_arguments(cfg: CurriculumConfig, out_dir: Path, precision: Precision) -> dict[str, Any]:
    """The ``GRPOConfig`` keywords of stage 3 (what ``birdtrain plan`` prints, too)."""
    s = cfg.stage3
    return {
        "output_dir": str(Path(out_dir) / "trainer"),
        "max_completion_length": s.max_completion_length,
        "reward_weights": [1.0, s.format_reward_weight] if s.format_reward_weight else [1.0],
        **grpo_arguments(
            cfg,
            s,
            precision,
            sequences=s.prompts_per_step * s.num_generations,
            max_model_length=s.max_prompt_length + s.max_completion_length,
        ),
    }


def build_trainer(
    cfg: CurriculumConfig,
    *,
    model_path: str,
    out_dir: Path,
    tasks: Iterable[Any],
    policy: Any = None,
) -> Any:
    """The configured ``GRPOTrainer`` (what :func:`run` trains)."""
    # the train extra: imported only where used
    from trl import GRPOConfig

    silence_trl_experimental()
    s = cfg.stage3
    tasks = list(tasks)
    model, tokenizer, peft_config, precision = load_for_training(cfg, model_path)
    dataset = build_dataset(tasks, tokenizer, s.max_prompt_length, cfg.prompt.options())
    check_batches("stage3", len(dataset), s.prompts_per_step, "prompts_per_step")
    kept = set(dataset["task_id"])
    reward_funcs: list[Any] = [_solution_reward]
    if s.format_reward_weight:
        reward_funcs.append(_format_reward)
    args = GRPOConfig(**trainer_arguments(cfg, out_dir, precision))
    contexts = s.prompts_per_step * s.num_generations  # one step generated together
    with colocated_kv_cache(args, model.name_or_path, contexts=contexts):
        return grpo_trainer_class(s.share_prompt)(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
            rollout_func=make_rollout_func(
                [t for t in tasks if t.instance_id in kept],
                s,
                prompt=cfg.prompt.options(),
                seed=cfg.seed,
                policy=policy,
                groups_path=Path(out_dir) / "groups.jsonl",
            ),
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


def run(
    cfg: CurriculumConfig,
    *,
    model_path: str,
    out_dir: Path,
    tasks: Iterable[Any],
    policy: Any = None,
) -> Path:
    """Train stage 3 from ``model_path`` on ``tasks``; return the checkpoint path.

    Writes ``out_dir/metrics.jsonl`` (per step: ``step``, ``loss``, ``learning_rate``,
    ``reward_mean``, ``reward_std``, ``pass_rate``, ``rewards/format_reward/mean``, ``kl``,
    ``frac_reward_zero_std``, the ``sampling/*`` figures of dynamic sampling, completion
    lengths…, then the trainer's summary) and the merged checkpoint with its tokenizer at
    ``out_dir/"checkpoint"``. ``policy(trainer) -> Policy`` samples instead of the trained model
    (tests); the loss is still the trained model's.
    """
    out_dir = Path(out_dir)
    trainer = build_trainer(cfg, model_path=model_path, out_dir=out_dir, tasks=tasks, policy=policy)
    train(trainer)
    return finish_stage(trainer, "stage3", out_dir, prompt=cfg.prompt.options(), extra=step_metrics)

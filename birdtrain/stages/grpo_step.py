"""The rollout-function skeleton of the GRPO stages (3 and 4): one generation step for TRL.

TRL 1.16's ``rollout_func(prompts, trainer)`` hook hands a stage the step's prompts (each task
repeated ``num_generations`` times in a row) and takes back the step's token columns. Both GRPO
stages answer it the same way, and only what they sample and what columns they hand back differ:

1. the step's distinct tasks and group size (:func:`~birdtrain.stages.training.prompt_groups`), and
   the actor that samples (:func:`~birdtrain.stages.training.stage_actor`);
2. the stage samples a group per task, and groups whose rewards are all equal are replaced by
   groups of other tasks (:func:`birdtrain.sampling.dynamic_sample`);
3. the step's draw is recorded (:func:`birdtrain.sampling.record_groups`);
4. the stage's columns for TRL, plus the sampling figures on every row (TRL hands reward
   functions one value per row).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from birdtrain.config import GRPOSettings
from birdtrain.sampling import Group, dynamic_sample, record_groups
from birdtrain.stages.training import prompt_groups, stage_actor

__all__ = ["Generate", "StepColumns", "rollout_function"]

#: Samples one group for each task id of its argument.
Generate = Callable[[list[str]], list[Group]]
#: The step's columns for TRL (``prompt_ids``, ``completion_ids``, ``logprobs``, the stage's own)
#: from the step's groups, one row per sample.
StepColumns = Callable[[list[Group]], dict[str, list[Any]]]


def rollout_function(
    stage: GRPOSettings,
    begin: Callable[[Any, Any, int], tuple[Generate, StepColumns]],
    *,
    policy: Any = None,
    pool: Sequence[str] | None = None,
    seed: int = 0,
    groups_path: Path | None = None,
) -> Callable[[list[Any], Any], dict[str, Any]]:
    """TRL's ``rollout_func(prompts, trainer)`` of a GRPO stage.

    ``begin(trainer, actor, group_size)`` starts a step and returns the stage's ``generate`` and
    ``columns`` for it (a step's own state lives in their closure). ``stage`` gives ``use_vllm``
    and ``dynamic_sampling_rounds``; ``policy(trainer) -> Policy`` replaces the trainer's model as
    the actor (scripted actors, tests). Replacement groups are drawn from ``pool`` (default: the
    step's own tasks, i.e. none) with a generator seeded by ``seed``. With ``groups_path`` each
    step's draw is appended there.
    """
    rng = random.Random(seed)

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        task_ids, group = prompt_groups(prompts)
        actor = stage_actor(trainer, policy)
        generate, columns = begin(trainer, actor, group)
        batch, stats = dynamic_sample(
            task_ids,
            generate,
            pool=list(pool) if pool is not None else task_ids,
            max_rounds=stage.dynamic_sampling_rounds,
            rng=rng,
        )
        if groups_path is not None:
            record_groups(groups_path, trainer.state.global_step + 1, stats)
        out = columns(batch)
        out["sampling_stats"] = [stats.metrics("sampling")] * len(out["prompt_ids"])
        return out

    return rollout_func

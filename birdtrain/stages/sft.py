"""Stages 1 and 2: supervised fine-tuning with TRL's ``SFTTrainer``.

- **Stage 1, reasoning imitation.** Examples in TRL's conversational prompt-completion form,
  ``{"prompt": [user message], "completion": [assistant message], "task_id"}``: the user message is
  :func:`birdtrain.prompts.single_turn_prompt`, the completion a ``<thought>…</thought>`` then
  ``<solution>…</solution>`` answer. The loss is on the completion only.
- **Stage 2, tool-use imitation.** Trajectories ``{"messages": [...], "tools": TOOL_SCHEMAS,
  "task_id"}`` where ``messages`` is exactly a BirdCriticEnv episode's ``info["messages"]``. With
  ``stage2.turns="each"`` (the default) every assistant turn becomes its own prompt-completion
  example (:func:`turn_examples`): the conversation before it is the
  prompt, the turn the completion and the only labelled tokens. This is what teaches a policy the
  call format quickly (each opening turn is an example of its own, not one span in a long chat)
  and what keeps a short ``max_length`` from cutting every turn after the limit.
  ``turns="first"`` keeps only the opening turns: what a very small model learns first (the
  smoke preset's tiny model learns the call format from them in a few dozen CPU steps). With
  ``turns="whole"`` a trajectory is one example with the loss on all its assistant turns:
  ``assistant_only_loss=True`` needs ``{% generation %}`` markers, and TRL swaps in its own
  training template for the Qwen3 template our policies carry, so the user prompt and every tool
  observation are labelled -100.

Read top to bottom: data → ``SFTConfig`` from the stage's config → train → metrics → merged save.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from birdtrain.config import CurriculumConfig
from birdtrain.stages.arguments import common_arguments, trainer_device_args
from birdtrain.stages.loading import load_for_training
from birdtrain.stages.outputs import finish_stage
from birdtrain.stages.precision import Precision
from birdtrain.stages.training import train

__all__ = [
    "build_dataset",
    "build_trainer",
    "generation_budgets",
    "run",
    "targets_over_budget",
    "trainer_arguments",
    "turn_examples",
]

logger = logging.getLogger(__name__)


def _message(message: dict[str, Any]) -> dict[str, str]:
    return {"role": message["role"], "content": message["content"]}


def _tools_text(tools: Any) -> str:
    return tools if isinstance(tools, str) else json.dumps(tools)


def turn_examples(trajectories: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One training example per assistant turn of each trajectory, in TRL's prompt-completion form.

    Turn k of a trajectory becomes ``{"prompt": messages[:k], "completion": [messages[k]],
    "tools", "task_id", "turn"}``: the conversation the policy had seen when it wrote that turn
    (user prompt, earlier turns, their observations: the same message objects, so byte for byte
    the environment's), and the turn itself, which alone carries the loss. Every turn is then
    trained with its own full context, as in stage 4 where each turn is generated from the
    conversation before it, and a short ``max_length`` cuts a late turn's context rather than
    every turn after the cut. The first turns, the ones that open every episode, get as many
    examples as the later ones.

    >>> traj = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
    ...     {"role": "tool", "content": "o1"}, {"role": "assistant", "content": "a2"}],
    ...     "tools": [], "task_id": "t"}
    >>> [(len(e["prompt"]), e["completion"][0]["content"], e["turn"]) for e in turn_examples([traj])]
    [(1, 'a1', 0), (3, 'a2', 1)]
    """
    examples: list[dict[str, Any]] = []
    for index, trajectory in enumerate(trajectories):
        messages = trajectory.get("messages")
        if not messages:
            raise ValueError(f"trajectory {index} has no 'messages'")
        turn = 0
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if k == 0:
                raise ValueError(
                    f"trajectory {index} opens with an assistant turn: nothing to condition it on"
                )
            examples.append(
                {
                    "prompt": list(messages[:k]),
                    "completion": [message],
                    "tools": trajectory.get("tools"),
                    "task_id": trajectory.get("task_id"),
                    "turn": turn,
                }
            )
            turn += 1
    return examples


def build_dataset(
    examples: Iterable[dict[str, Any]] | Any, stage: int, *, turns: str = "whole"
) -> Any:
    """A ``datasets.Dataset`` with only the columns SFT trains on for ``stage`` (1 or 2).

    Stage 2 takes trajectories (``messages``, ``tools``); ``turns="each"`` splits them into one
    prompt-completion example per assistant turn, ``"first"`` keeps only each opening turn (the
    user prompt and the first call), ``"whole"`` keeps one example per trajectory.
    Stage 2's ``tools`` become JSON text: Arrow would merge the two tool schemas' different
    ``properties`` into one struct and fill the missing keys with nulls, changing the rendered
    prompt; TRL ``json.loads`` a string ``tools`` back, unchanged.
    """
    # the train extra: imported only where used
    from datasets import Dataset

    if turns not in ("each", "first", "whole"):
        raise ValueError(f"turns must be 'each', 'first' or 'whole', got {turns!r}")
    rows = list(examples) if not isinstance(examples, Dataset) else examples.to_list()
    if not rows:
        raise ValueError(f"stage {stage}: no training examples")
    if stage == 1:
        missing = [i for i, r in enumerate(rows) if "prompt" not in r or "completion" not in r]
        if missing:
            raise ValueError(
                f"stage 1 examples need 'prompt' and 'completion' (conversational prompt-completion); "
                f"example {missing[0]} has keys {sorted(rows[missing[0]])}"
            )
        return Dataset.from_list(
            [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows]
        )
    if stage == 2:
        missing = [i for i, r in enumerate(rows) if "messages" not in r]
        if missing:
            raise ValueError(
                f"stage 2 examples need 'messages' (and 'tools'); example {missing[0]} has keys "
                f"{sorted(rows[missing[0]])}"
            )
        if turns in ("each", "first"):
            return Dataset.from_list(
                [
                    {
                        "prompt": [_message(m) for m in e["prompt"]],
                        "completion": [_message(m) for m in e["completion"]],
                        "tools": _tools_text(e.get("tools")),
                    }
                    for e in turn_examples(rows)
                    if turns == "each" or e["turn"] == 0
                ]
            )
        return Dataset.from_list(
            [
                {
                    "messages": [
                        {"role": m["role"], "content": m["content"]} for m in r["messages"]
                    ],
                    "tools": _tools_text(r.get("tools")),
                }
                for r in rows
            ]
        )
    raise ValueError(f"stage must be 1 or 2, got {stage!r}")


def trainer_arguments(
    cfg: CurriculumConfig, out_dir: Path, precision: Precision, stage: int
) -> dict[str, Any]:
    """The ``SFTConfig`` keywords of stage ``stage`` (what ``birdtrain plan`` prints, too)."""
    stage_cfg = cfg.stage1 if stage == 1 else cfg.stage2
    per_turn = stage == 2 and stage_cfg.turns in ("each", "first")
    return {
        "output_dir": str(Path(out_dir) / "trainer"),
        "num_train_epochs": stage_cfg.epochs,
        "max_steps": stage_cfg.max_steps,
        "learning_rate": stage_cfg.learning_rate,
        "per_device_train_batch_size": stage_cfg.per_device_batch_size,
        "gradient_accumulation_steps": stage_cfg.batch_size // stage_cfg.per_device_batch_size,
        "warmup_steps": stage_cfg.warmup_ratio,  # a float below 1 is a ratio of the total steps
        "max_length": stage_cfg.max_length,
        # Stage 1 and per-turn stage 2: loss on the completion only; whole trajectories: on the
        # assistant turns only.
        "completion_only_loss": stage == 1 or per_turn,
        "assistant_only_loss": stage == 2 and not per_turn,
        "dataset_num_proc": None,
        **common_arguments(cfg, stage_cfg),
        **trainer_device_args(precision, cfg.model),
    }


def build_trainer(
    cfg: CurriculumConfig, *, model_path: str, out_dir: Path, examples: Any, stage: int
) -> Any:
    """The configured ``SFTTrainer`` for ``stage`` (what :func:`run` trains; tests inspect it)."""
    # the train extra: imported only where used
    from trl import SFTConfig, SFTTrainer

    stage_cfg = cfg.stage1 if stage == 1 else cfg.stage2
    dataset = build_dataset(examples, stage, turns=stage_cfg.turns if stage == 2 else "whole")
    model, tokenizer, peft_config, precision = load_for_training(cfg, model_path)
    args = SFTConfig(**trainer_arguments(cfg, out_dir, precision, stage))
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    # TRL truncates to max_length and then drops examples left with no trained token: a limit
    # below the prompt's length silently empties the data set.
    if len(trainer.train_dataset) == 0:
        raise ValueError(
            f"stage {stage}: all {len(dataset)} examples lost every trained token to truncation "
            f"at stage{stage}.max_length={stage_cfg.max_length}; raise it"
        )
    if len(trainer.train_dataset) < len(dataset):
        logger.warning(
            "stage %d: %d of %d examples dropped: truncated at max_length=%d before any trained token",
            stage,
            len(dataset) - len(trainer.train_dataset),
            len(dataset),
            stage_cfg.max_length,
        )
    too_long = targets_over_budget(cfg, stage, trainer.train_dataset)
    if too_long:
        logger.warning("%s", too_long)
    return trainer


def generation_budgets(cfg: CurriculumConfig, stage: int) -> dict[str, int]:
    """The token limits under which the policy later generates what SFT stage ``stage`` teaches.

    Stage 1 teaches single-turn answers (stage 3 and single-turn evaluation generate them),
    stage 2 agent turns (stage 4 and agent-mode evaluation), each only where enabled.
    """
    budgets = {}
    rl = cfg.stage3 if stage == 1 else cfg.stage4
    if rl.enabled:
        key = "stage3.max_completion_length" if stage == 1 else "stage4.max_new_tokens"
        budgets[key] = rl.max_completion_length if stage == 1 else rl.max_new_tokens
    if cfg.eval.enabled and ("single" if stage == 1 else "agent") in cfg.eval.modes:
        budgets["eval.max_new_tokens"] = cfg.eval.max_new_tokens
    return budgets


def _trained_spans(row: dict[str, Any]) -> list[int]:
    """The lengths of a tokenized example's trained spans (a completion, or each assistant turn)."""
    spans, run = [], 0
    for label in [*row["labels"], -100]:
        if label != -100:
            run += 1
        elif run:
            spans.append(run)
            run = 0
    return spans


def targets_over_budget(cfg: CurriculumConfig, stage: int, tokenized: Any) -> str | None:
    """Why SFT stage ``stage`` teaches answers the policy may not finish later, or None.

    ``tokenized`` is the trainer's tokenized data set. A trained span (a stage-1 answer, a stage-2
    turn) longer than a later generation limit is cut there every time: the policy can never
    produce it whole, and a cut answer or tool call scores 0.
    """
    budgets = generation_budgets(cfg, stage)
    if not budgets:
        return None
    limit = min(budgets.values())
    spans = [n for row in tokenized for n in _trained_spans(row)]
    over = [n for n in spans if n > limit]
    if not over:
        return None
    what = "answers" if stage == 1 else "assistant turns"
    limits = ", ".join(f"{k}={v}" for k, v in budgets.items())
    return (
        f"stage {stage}: {len(over)} of {len(spans)} trained {what} are longer than the "
        f"{limit} tokens the policy may generate for them later ({limits}); the longest is "
        f"{max(over)} tokens. Those are cut off every time: raise the limits"
        + (" or shorten the thoughts (data.thought_rows)" if stage == 1 else "")
    )


def run(
    cfg: CurriculumConfig,
    *,
    model_path: str,
    out_dir: Path,
    examples: Iterable[dict[str, Any]] | Any,
    stage: int,
) -> Path:
    """Train stage ``stage`` (1 or 2) from ``model_path`` on ``examples``; return the checkpoint path.

    Writes ``out_dir/metrics.jsonl`` (``step``, ``loss``, ``learning_rate``,
    ``mean_token_accuracy``, ``num_tokens``… per step, then the trainer's summary) and the merged
    checkpoint with its tokenizer at ``out_dir/"checkpoint"``.
    """
    out_dir = Path(out_dir)
    trainer = build_trainer(
        cfg, model_path=model_path, out_dir=out_dir, examples=examples, stage=stage
    )
    train(trainer)
    return finish_stage(trainer, f"stage{stage}", out_dir, prompt=cfg.prompt.options())

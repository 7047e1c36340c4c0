"""Scoring a GRPO group's completions on one forward pass of their common prompt.

GRPO samples ``num_generations`` completions of each prompt, and TRL scores each one (the
loss's log-probabilities, and the reference and old-policy ones) by a forward pass over the
whole sequence, prompt included: a group of 8 reads its prompt 8 times. With BIRD-RL's prompts
(a schema and an issue; ~1.2k tokens for SmolLM2 in stage 3, against ~300 of completion) that is
most of a step's compute. Here the rows of a batch that share a prompt run it once, with its
keys and values kept (``use_cache``), and then only their completions, attending to those keys
and values repeated per row. Gradients flow back through the repeated keys and values into the
one prompt pass, so the loss and its gradient are those of the full pass (same values up to
floating-point rounding; `tests/test_stages.py` compares both).

Positions start at 0 on the prompt's first real token, as in generation; TRL's full pass numbers
a left-padded row from its first padding token instead, which rotary embeddings (relative
positions) make the same.

Used only where it is exact and possible: no multimodal inputs, no MoE auxiliary loss, and no
gradient checkpointing under autograd (a checkpointed layer drops the cache it would have to
fill twice); otherwise TRL's own pass runs.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from birdtrain.policies import backbone, kv_cache_keyword, unwrapped

__all__ = ["grpo_trainer_class", "shared_prompt_logps"]

# Keyword arguments of ``_get_per_token_logps_and_entropies`` for inputs the shared pass does not
# carry (images, token types): with any of them set, TRL's pass runs.
_MULTIMODAL = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def _checkpointing(model: Any) -> bool:
    base = unwrapped(model)
    # transformers 5 renamed the property (the old name warns)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(base), name):
            return bool(getattr(base, name))
    return False


def shared_prompt_logps(
    model: Any,
    input_ids: Any,
    attention_mask: Any,
    logits_to_keep: int,
    *,
    batch_size: int | None = None,
    compute_entropy: bool = False,
    autocast: Any = None,
) -> tuple[Any, Any]:
    """Per-token log-probabilities (and entropies, else None) of the last ``logits_to_keep``
    tokens of each row, as TRL's ``GRPOTrainer._get_per_token_logps_and_entropies`` returns them,
    with each distinct prompt of a chunk of ``batch_size`` rows run once.

    ``input_ids`` / ``attention_mask``: left-padded prompts, then right-padded completions
    (TRL's layout); ``model`` carries TRL's fused LM head (``fused_lm_head=True``);
    ``autocast``: a context manager factory (the trainer's ``accelerator.autocast``).
    """

    # the train extra: imported only where used
    import torch

    rows, width = input_ids.shape
    prompt_width = width - logits_to_keep
    batch_size = batch_size or rows
    autocast = autocast or contextlib.nullcontext
    logps: list[Any] = [None] * rows
    entropies: list[Any] = [None] * rows
    for start in range(0, rows, batch_size):
        prompts: dict[tuple[int, ...], list[int]] = {}
        for row in range(start, min(start + batch_size, rows)):
            real = attention_mask[row, :prompt_width].bool()
            prompts.setdefault(tuple(input_ids[row, :prompt_width][real].tolist()), []).append(row)
        for prompt, members in prompts.items():
            with autocast():
                outputs = _score_completions(
                    model,
                    prompt,
                    input_ids[members, prompt_width:],
                    attention_mask[members, prompt_width:],
                )
            for i, row in enumerate(members):
                logps[row] = outputs.log_probs[i, -logits_to_keep:]
                if compute_entropy:
                    entropies[row] = outputs.entropy[i, -logits_to_keep:]
    return torch.stack(logps), torch.stack(entropies) if compute_entropy else None


def _score_completions(model: Any, prompt: tuple[int, ...], completions: Any, masks: Any) -> Any:
    """The fused head's output over ``completions`` (right-padded, with ``masks``), each after
    ``prompt``: the prompt but its last token runs once, its keys and values repeated per row."""
    # the train extra: imported only where used
    import torch
    from transformers import DynamicCache

    decoder = backbone(model)
    keyword = kv_cache_keyword(decoder)
    device = completions.device
    n = completions.size(0)
    prompt_ids = torch.tensor([prompt], device=device)
    prefix = prompt_ids[:, :-1]
    cache = DynamicCache(config=decoder.config)
    if prefix.size(1):
        decoder(input_ids=prefix, use_cache=True, **{keyword: cache})
    cache.batch_repeat_interleave(n)
    # The prompt's last token predicts the first completion token: it leads the suffix.
    suffix = torch.cat([prompt_ids[:, -1:].expand(n, 1), completions], dim=1)
    suffix_mask = torch.cat([torch.ones_like(masks[:, :1]), masks], dim=1)
    labels = suffix.masked_fill(suffix_mask == 0, -100)
    labels[:, 0] = -100
    attention = torch.cat(
        [torch.ones_like(masks[:, :1]).expand(n, prefix.size(1)), suffix_mask], dim=1
    )
    positions = torch.arange(prefix.size(1), prefix.size(1) + suffix.size(1), device=device)
    return model(
        input_ids=suffix,
        attention_mask=attention,
        position_ids=positions.unsqueeze(0).expand(n, -1),
        labels=labels,
        fused_lm_head=True,
        **{keyword: cache},
    )


@functools.cache
def _trainer_class() -> type:
    # the train extra: imported only where used
    from trl import GRPOTrainer

    class SharedPromptGRPOTrainer(GRPOTrainer):
        """TRL's ``GRPOTrainer``, scoring the completions of a prompt on one pass of it
        (:func:`shared_prompt_logps`) wherever that is exact; everything else is TRL's."""

        def _get_per_token_logps_and_entropies(
            self,
            model: Any,
            input_ids: Any,
            attention_mask: Any,
            logits_to_keep: int,
            batch_size: int | None = None,
            compute_entropy: bool = False,
            compute_aux_loss: bool = False,
            **inputs: Any,
        ) -> tuple[Any, Any, Any]:
            # the train extra: imported only where used
            import torch

            if (
                compute_aux_loss
                or any(inputs.get(k) is not None for k in _MULTIMODAL)
                or (torch.is_grad_enabled() and _checkpointing(model))
            ):
                return super()._get_per_token_logps_and_entropies(
                    model,
                    input_ids,
                    attention_mask,
                    logits_to_keep,
                    batch_size,
                    compute_entropy,
                    compute_aux_loss,
                    **inputs,
                )
            logps, entropies = shared_prompt_logps(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                autocast=self.accelerator.autocast,
            )
            return logps, entropies, None

    return SharedPromptGRPOTrainer


def grpo_trainer_class(share_prompt: bool) -> type:
    """The ``GRPOTrainer`` class of a stage: TRL's, or with ``share_prompt`` the subclass above."""
    # the train extra: imported only where used
    from trl import GRPOTrainer

    return _trainer_class() if share_prompt else GRPOTrainer

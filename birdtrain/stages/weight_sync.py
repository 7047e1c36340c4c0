"""Weight sync from a LoRA-trained model to TRL's vLLM engine, with the frozen base left untouched.

TRL 1.16 syncs a PEFT model to vLLM by merging the adapters into the base weights in place
(``merge_adapter``), reading the merged weights, and unmerging them (``unmerge_adapter``): peft
adds ``B @ A * scaling`` to the weight and later subtracts it. In bfloat16 the round trip is not
exact: each cycle leaves rounding error in the frozen base, which is also the KL reference and
the model the adapters train on. Here each merged weight is computed out of place instead,
``(W.float() + ΔW).to(W.dtype)``, and only that copy goes to vLLM; the trainer's weights are only
read.

:func:`install` puts this in place of TRL's parameter iterator (``_iter_named_params``, the one
both colocate and server modes read from). On vLLM's CPU backend, which repacks each linear
layer's weights after loading and so refuses TRL's per-parameter ``load_weights``, the colocated
load goes through vLLM's own ``reload_weights`` (all weights, in checkpoint format).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

__all__ = ["checkpoint_name", "install", "merged_named_params"]


def merged_named_params(model: Any, rename: Any) -> Iterator[tuple[str, Any]]:
    """``(vLLM name, tensor)`` of every weight of the PEFT ``model`` with its active LoRA
    adapters merged, each merged weight a new tensor ``(W.float() + ΔW).to(W.dtype)``; weights
    without an adapter are yielded as they are (read only). ``rename(name)``: TRL's own mapping of
    a parameter name to vLLM's (``VLLMGeneration._fix_param_name_to_vllm``), after peft's
    prefixes are dropped as TRL drops them."""
    # the train extra: imported only where used
    import torch
    from peft.tuners.lora import LoraLayer

    adapters: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, LoraLayer) and not module.merged and not module.disable_adapters:
            if any(module.use_dora.get(a) for a in module.active_adapters):
                raise ValueError("the out-of-place vLLM weight sync does not merge DoRA adapters")
            adapters[id(module.get_base_layer().weight)] = module
    for peft_name, param in model.named_parameters():
        name = checkpoint_name(peft_name, model.prefix)
        if name is None:
            continue  # adapters (merged below) and the unused copy of a module trained whole
        layer = adapters.get(id(param))
        weight = param.detach()
        if layer is not None:
            with torch.no_grad():
                # A copy even of a float32 base: ``.float()`` would return the weight itself, and
                # the sum below would add the adapters into the frozen base at every sync.
                merged = weight.to(torch.float32, copy=True)
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        merged += layer.get_delta_weight(adapter).float()
                weight = merged.to(param.dtype)
        yield rename(name), weight


def checkpoint_name(name: str, adapter_prefix: str) -> str | None:
    """The name a weight or buffer ``name`` of a PEFT model has in a plain checkpoint, or None
    for an adapter's own weight (``adapter_prefix``: ``lora_`` for LoRA) and for the unused copy
    of a module trained whole (``modules_to_save``)."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if adapter_prefix in name or "original_module" in name:
        return None
    return name.replace("modules_to_save.default.", "")


def _iter_named_params(generation: Any) -> Iterator[tuple[str, Any]]:
    yield from merged_named_params(generation.model, generation._fix_param_name_to_vllm)


def _reload_on_cpu(generation: Any) -> None:
    """vLLM's CPU backend: every weight reloaded in checkpoint format, then the prefix cache reset."""
    runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    runner.reload_weights(
        weights_iterator=generation._iter_named_params(), is_checkpoint_format=True
    )
    generation.llm.reset_prefix_cache()


def install(trainer: Any) -> None:
    """Make ``trainer``'s vLLM weight sync merge LoRA adapters out of place, and load through
    ``reload_weights`` on vLLM's CPU backend (a no-op without vLLM; without adapters TRL reads
    the trained weights as they are)."""
    # the train extra: imported only where used
    from peft import PeftModel

    generation = getattr(trainer, "vllm_generation", None)
    if generation is None:
        return
    if isinstance(generation.model, PeftModel):
        if generation._dist.is_fsdp or generation._dist.is_zero3:
            # Sharded weights: TRL gathers them around its own merge; birdtrain uses one device.
            raise ValueError("the out-of-place vLLM weight sync supports one unsharded model")
        generation._iter_named_params = types.MethodType(_iter_named_params, generation)
    if generation.mode == "colocate":
        # the vllm extra: imported only where used
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            generation.sync_weights = types.MethodType(_reload_on_cpu, generation)

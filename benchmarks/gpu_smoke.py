"""The checks of ``benchmarks/gpu_smoke.sh``, one subcommand each; each prints one JSON object.

``build DIR``: a random-weight Qwen2-architecture model built from a config (no hub), with the
project's offline tokenizer (the ``tiny`` model's: Qwen's chat markers) and two end-of-turn ids,
as Qwen2.5's checkpoints declare them. ``plan DIR``: ``birdtrain plan``'s settings and peak per
stage for that model. ``stage3 DIR OUT`` / ``stage4 DIR OUT``: two GRPO steps with TRL's colocated
vLLM, LoRA on a bfloat16 base, gradient checkpointing; stage 3 also checks the weight sync (the
frozen base bit-identical, vLLM computing exactly what it computes from a peft-merged checkpoint)
and both report their peak GPU memory. The stage commands take config overrides after their
arguments (``KEY=VALUE``, as ``birdtrain train`` takes them).

On a CPU (the ``.venv-vllm`` lane of ``make test``, vLLM's CPU build) everything but the GPU
memory runs too: ``tests/test_vllm.py`` runs these subcommands.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any


def _free_port() -> int:
    """A port the system has just found free on 127.0.0.1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# TRL's colocated engine joins a one-process torch.distributed group. Given no port (or "0"),
# TRL takes the first free one of 29500, 23456, ...: two checks starting at once (the lane runs
# two test processes) both took 29500, and the second failed with EADDRINUSE.
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ["MASTER_PORT"] = str(_free_port())

#: The checked model: Qwen2's architecture, small enough to train in seconds on one GPU (and on a
#: CPU), with head size 64 (one vLLM's CPU kernel takes too).
QWEN2_SHAPE = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


#: The shapes :func:`build` makes, by name. ``check``: the model above, its vocabulary the
#: tokenizer's. ``qwen2.5-coder-7b``: Qwen2.5-Coder-7B-Instruct's exact shape (7.62 B parameters, a
#: vocabulary of 152,064: ``birdtrain.plan``'s table of known models), as the device check trains
#: it. ``tiny``: that architecture at a tiny width for a dry run on a CPU, its vocabulary larger than
#: the tokenizer's as Qwen's is (ids past the tokenizer decode to nothing).
SHAPES = ("check", "qwen2.5-coder-7b", "tiny")
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "vocab_size": 8192,
}


def _shape(name: str) -> dict[str, Any]:
    from birdtrain.plan import KNOWN_MODELS

    if name == "qwen2.5-coder-7b":
        known = dict(KNOWN_MODELS["Qwen/Qwen2.5-Coder-7B-Instruct"])
        known.pop("model_type")
        return known
    if name == "tiny":
        return dict(TINY_SHAPE)
    if name == "check":
        return dict(QWEN2_SHAPE)
    raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")


def build(out: str, shape: str = "check") -> dict[str, Any]:
    """The random Qwen2 model of ``shape`` (:data:`SHAPES`) in bfloat16 with the offline tokenizer
    and two EOS ids, saved at ``out``. It is made on the GPU when there is one: 7.6 B parameters
    take seconds there and minutes on a CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config

    from birdtrain.models import build_tiny_model, prompt_corpus

    path = Path(out)
    build_tiny_model(path, vocab_size=4096, corpus=prompt_corpus(), local_window=None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    values = {"vocab_size": len(tokenizer), **_shape(shape)}
    torch.manual_seed(0)
    config = Qwen2Config(eos_token_id=eos[0], pad_token_id=tokenizer.pad_token_id, **values)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[1])
    for stale in path.glob("*.safetensors"):
        stale.unlink()  # the tiny model's weights
    model.save_pretrained(path)
    return {
        "path": str(path),
        "eos_token_ids": eos,
        "model_type": config.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": config.vocab_size,
        "tokenizer_size": len(tokenizer),
    }


def _config(model: str, out: str, *extra: str) -> Any:
    from birdtrain.config import load_config

    return load_config(
        "smoke",
        overrides=[
            f"model.name_or_path={model}",
            "model.lora=true",
            "model.dtype=bfloat16",
            "model.gradient_checkpointing=true",
            f"output_dir={out}",
            "stage3.use_vllm=true",
            "stage3.vllm_gpu_memory_utilization=0.3",
            "stage3.max_completion_length=32",
            "stage4.use_vllm=true",
            "stage4.vllm_gpu_memory_utilization=0.3",
            "stage4.max_new_tokens=32",
            "stage4.max_turns=2",
            *extra,
        ],
    )


def plan(model: str, gpu_gb: str = "80") -> dict[str, Any]:
    """``birdtrain plan``'s peak (GB) and settings of stages 3 and 4 as :func:`stage3` and
    :func:`stage4` run them, on a card of ``gpu_gb`` GB."""
    from birdtrain.plan import plan as plan_stages

    stages = plan_stages(_config(model, "plan"), gpu_gb=float(gpu_gb))
    return {
        p.stage: {"peak_gb": p.peak, "fits": p.fits}
        for p in stages
        if p.stage in ("stage3", "stage4")
    }


def _peak_gb() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_reserved() / 1e9


def _greedy_logprobs(llm: Any, ids: list[int]) -> list[float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, prompt_logprobs=0)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    prompt = [next(iter(step.values())).logprob for step in out.prompt_logprobs[1:]]
    sampled = [next(iter(step.values())).logprob for step in out.outputs[0].logprobs]
    return prompt + sampled


def stage3(model: str, out: str, *overrides: str) -> dict[str, Any]:
    """Two steps of stage 3 with colocated vLLM; the weight sync's checks and the peak memory.

    The learning rate (0.05 unless ``overrides`` set one) moves the adapters by more than
    bfloat16's rounding of the base, so an in-place merge and unmerge (TRL's own sync) would
    change the base.
    """
    import torch

    from birdenv.tasks import load_tasks
    from birdtrain.stages import grpo
    from birdtrain.stages.training import train

    cfg = _config(model, out, "stage3.learning_rate=0.05", *overrides)
    trainer = grpo.build_trainer(
        cfg, model_path=model, out_dir=Path(out) / "s3", tasks=load_tasks("critic-mini")[:2]
    )
    peft_model = trainer.model
    base = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" not in n}
    device = next(peft_model.parameters()).device
    probe = torch.tensor(
        [trainer.processing_class.encode("SELECT name FROM customers WHERE")], device=device
    )
    with torch.no_grad(), peft_model.disable_adapter():
        reference = peft_model(probe).logits
    train(trainer)
    with torch.no_grad(), peft_model.disable_adapter():
        reference_kept = torch.equal(peft_model(probe).logits, reference)
    generation = trainer.vllm_generation
    generation.sync_weights()  # the weights after the last step
    ids = probe[0].tolist()
    synced = _greedy_logprobs(generation.llm, ids)
    # What vLLM computes from a checkpoint of the adapters merged by peft: the same engine and
    # kernels, so equal to the last bit when the sync loaded exactly the merged weights.
    merged_dir = Path(out) / "merged"
    copy.deepcopy(peft_model).merge_and_unload().save_pretrained(merged_dir)
    runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    runner.reload_weights(weights_path=str(merged_dir))
    generation.llm.reset_prefix_cache()
    logged = [r for r in trainer.state.log_history if "loss" in r]
    return {
        "steps": trainer.state.global_step,
        "base_dtypes": sorted({str(p.dtype) for p in base.values()}),
        "base_changed": [
            n for n, p in peft_model.named_parameters() if n in base and not torch.equal(p, base[n])
        ],
        "adapters_trained": any(
            p.abs().max().item() > 0 for n, p in peft_model.named_parameters() if "lora_B" in n
        ),
        "reference_kept": reference_kept,
        "synced": synced,
        "from_merged_checkpoint": _greedy_logprobs(generation.llm, ids),
        "logp_difference": [r["sampling/sampling_logp_difference/mean"] for r in logged],
        "peak_gb": _peak_gb(),
    }


def stage3_full(model: str, out: str, *overrides: str) -> dict[str, Any]:
    """Two steps of stage 3 with colocated vLLM, fully fine-tuned (no LoRA): whether vLLM then
    computes exactly what it computes from a checkpoint of the trained weights."""
    from birdenv.tasks import load_tasks
    from birdtrain.stages import grpo
    from birdtrain.stages.training import train

    cfg = _config(
        model,
        out,
        "model.lora=false",
        "model.dtype=float32",
        "stage3.learning_rate=0.01",
        *overrides,
    )
    trainer = grpo.build_trainer(
        cfg, model_path=model, out_dir=Path(out) / "s3", tasks=load_tasks("critic-mini")[:2]
    )
    train(trainer)
    generation = trainer.vllm_generation
    generation.sync_weights()  # the weights after the last step
    ids = trainer.processing_class.encode("SELECT name FROM customers WHERE")
    synced = _greedy_logprobs(generation.llm, ids)
    trainer.model.save_pretrained(Path(out) / "trained")
    runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    runner.reload_weights(weights_path=str(Path(out) / "trained"))
    generation.llm.reset_prefix_cache()
    return {
        "steps": trainer.state.global_step,
        "synced": synced,
        "from_checkpoint": _greedy_logprobs(generation.llm, ids),
    }


def stage4(model: str, out: str, *overrides: str) -> dict[str, Any]:
    """Two steps of stage 4 (multi-turn, in the environment) with colocated vLLM; its metrics,
    checkpoint and peak memory."""
    from birdenv.tasks import load_tasks
    from birdtrain.stages import agentic

    checkpoint = agentic.run(
        _config(model, out, *overrides),
        model_path=model,
        out_dir=Path(out) / "s4",
        tasks=load_tasks("critic-mini")[:2],
    )
    lines = (Path(out) / "s4" / "metrics.jsonl").read_text().splitlines()
    return {
        "records": [json.loads(line) for line in lines],
        "checkpoint": str(checkpoint),
        "peak_gb": _peak_gb(),
    }


COMMANDS = {
    "build": build,
    "plan": plan,
    "stage3": stage3,
    "stage3_full": stage3_full,
    "stage4": stage4,
}

if __name__ == "__main__":
    command, *args = sys.argv[1:]
    print("RESULT " + json.dumps(COMMANDS[command](*args)))

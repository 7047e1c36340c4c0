"""What bfloat16 saves in sampling a turn: SmolLM2-135M on CPU, float32 and bfloat16 side by side.

One batch as the ``smollm-learn`` preset samples it: 8 agent prompts of its training tasks (linked
schema, no sample rows, the tools; ~1.1-2.4k tokens of SmolLM2's tokenizer) read and continued by
32 greedy tokens each, through :class:`birdtrain.policies.TransformersPolicy` (the sampler of
stages 3-4, difficulty estimates and evaluations). ``bfloat16`` runs it under CPU autocast, as a
stage with ``model.dtype=bfloat16`` samples. ``test_decode_width`` measures what a wider batch
(``eval.num_envs``) buys in decoding, where the base model spends its "before" evaluation. Run
with ``pytest benchmarks/test_sampling.py --benchmark-only -m slow``; figures in benchmarks/README.md
("bfloat16 on the CPU", "Batch width").
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the train extra")

# Minutes each and gigabytes of memory on a 2-core CPU: outside the default benchmark set.
pytestmark = pytest.mark.slow

ROWS = 8
NEW_TOKENS = 32
#: Prompts of the width benchmark: every width reads and continues the same ones.
WIDTH_ROWS = 16
DECODE_TOKENS = 128


@pytest.fixture(scope="module")
def prompts() -> tuple:
    """``(model path, token ids of each of ROWS agent prompts)``."""
    from birdenv.envs.critic import render_prompt
    from birdenv.tools import TOOL_SCHEMAS
    from birdtrain.config import load_config
    from birdtrain.data import load_train_tasks
    from birdtrain.models import load_tokenizer, resolve_model

    path = resolve_model("smollm")
    tokenizer = load_tokenizer(path)
    cfg = load_config(preset="smollm-learn")
    batch = []
    for task in load_train_tasks(cfg)[:WIDTH_ROWS]:
        messages = [{"role": "user", "content": render_prompt(task, cfg.prompt.options())}]
        ids = tokenizer.apply_chat_template(
            messages,
            tools=TOOL_SCHEMAS,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        batch.append(list(ids))
    return path, batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampling_time(benchmark, prompts: tuple, dtype: str) -> None:
    from birdtrain.models import load_policy
    from birdtrain.policies import TransformersPolicy
    from birdtrain.stages.precision import cpu_bf16_supported

    if dtype == "bfloat16" and not cpu_bf16_supported():
        pytest.skip("this CPU has no native bfloat16 instructions")
    path, batch = prompts
    batch = batch[:ROWS]
    policy = TransformersPolicy(*load_policy(path, dtype="float32"), dtype=dtype)
    turns: list = []

    def sample() -> None:
        turns[:] = policy.generate(batch, max_new_tokens=NEW_TOKENS, temperature=0)

    benchmark.pedantic(sample, rounds=2, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update(
        context_tokens=[len(ids) for ids in batch],
        first_row_tokens=turns[0][0],
    )


def test_decode_width(benchmark, prompts: tuple) -> None:
    """Decoding tokens per second at a batch width of 8 (the default ``eval.num_envs``) and 16,
    side by side in bfloat16: the same 16 prompts, read once with 1 new token (the prefill) and
    once with ``DECODE_TOKENS`` greedy ones each; the difference is the decoding."""
    import time

    from birdtrain.models import load_policy
    from birdtrain.policies import TransformersPolicy
    from birdtrain.stages.precision import cpu_bf16_supported

    if not cpu_bf16_supported():
        pytest.skip("this CPU has no native bfloat16 instructions")
    path, batch = prompts
    policy = TransformersPolicy(*load_policy(path, dtype="float32"), dtype="bfloat16")

    def run(width: int, new_tokens: int) -> tuple[float, int]:
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(batch), width):
            turns = policy.generate(batch[i : i + width], max_new_tokens=new_tokens, temperature=0)
            tokens += sum(len(ids) for ids, _ in turns)
        return time.perf_counter() - start, tokens

    figures = {}
    for width in (8, 16):
        prefill, _ = run(width, 1)
        whole, tokens = run(width, DECODE_TOKENS)
        figures[width] = {
            "prefill_s": prefill,
            "whole_s": whole,
            "new_tokens": tokens,
            "decode_tokens_per_s": (tokens - len(batch)) / (whole - prefill),
        }
    benchmark.pedantic(run, args=(16, 1), rounds=1, iterations=1)
    benchmark.extra_info.update(
        widths=figures,
        speedup_16_over_8=figures[16]["decode_tokens_per_s"] / figures[8]["decode_tokens_per_s"],
        context_tokens=[len(ids) for ids in batch],
    )

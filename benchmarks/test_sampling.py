"""What bfloat16 saves in sampling a turn: SmolLM2-135M on CPU, float32 and bfloat16 side by side.

One batch as the ``smollm-learn`` preset samples it: 8 agent prompts of its training tasks (linked
schema, no sample rows, the tools; ~1.1-2.4k tokens of SmolLM2's tokenizer) read and continued by
32 greedy tokens each, through :class:`birdtrain.policies.TransformersPolicy` (the sampler of
stages 3-4, difficulty estimates and evaluations). ``bfloat16`` runs it under CPU autocast, as a
stage with ``model.dtype=bfloat16`` samples. Run with
``pytest benchmarks/test_sampling.py --benchmark-only``; figures in benchmarks/README.md
("bfloat16 on the CPU").
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the train extra")

ROWS = 8
NEW_TOKENS = 32


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
    for task in load_train_tasks(cfg)[:ROWS]:
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
    from birdtrain.stages import cpu_bf16_supported

    if dtype == "bfloat16" and not cpu_bf16_supported():
        pytest.skip("this CPU has no native bfloat16 instructions")
    path, batch = prompts
    policy = TransformersPolicy(*load_policy(path, dtype="float32"), dtype=dtype)
    turns: list = []

    def sample() -> None:
        turns[:] = policy.generate(batch, max_new_tokens=NEW_TOKENS, temperature=0)

    benchmark.pedantic(sample, rounds=2, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update(
        context_tokens=[len(ids) for ids in batch],
        first_row_tokens=turns[0][0],
    )

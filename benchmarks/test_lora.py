"""What speeds up a training step of SmolLM2-135M on CPU? Full fine-tuning in float32, in
bfloat16 under CPU autocast (``model.dtype=bfloat16``), and LoRA, side by side.

One SFT-shaped step (forward, backward, AdamW update) on a stage-2-sized example: a linked-schema
prompt and one tool-call turn, ~600 tokens of SmolLM2's tokenizer. LoRA trains ~1 % of the
weights, so the optimizer is nearly free, but the forward and backward passes still run through
every frozen layer: on CPU the step is bound by those, not by the optimizer. bfloat16 makes those
passes cheaper where the CPU computes it natively (AVX512-BF16, AMX). Run with ``make bench`` or
``pytest benchmarks/test_lora.py --benchmark-only -m slow``; figures in benchmarks/README.md ("LoRA on
CPU", "bfloat16 on the CPU").
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the train extra")

# Minutes each and gigabytes of memory on a 2-core CPU: outside the default benchmark set.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def example() -> tuple:
    from birdenv.envs.critic import render_prompt
    from birdenv.schema import PromptOptions
    from birdenv.tasks import load_tasks
    from birdenv.tools import TOOL_SCHEMAS, format_tool_call
    from birdtrain.models import load_tokenizer, resolve_model

    path = resolve_model("smollm")
    tokenizer = load_tokenizer(path)
    task = load_tasks("critic-mini")[0]
    prompt = render_prompt(task, PromptOptions(schema="linked", sample_rows=False))
    messages = [
        {"role": "user", "content": prompt},
        {
            "role": "assistant",
            "content": format_tool_call("submit_solution", sql_list=task.sol_sql),
        },
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOL_SCHEMAS, tokenize=False)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    return path, ids


@pytest.mark.parametrize(
    ("lora", "dtype"),
    [(False, "float32"), (False, "bfloat16"), (True, "float32")],
    ids=["full", "full-bf16", "lora-r16"],
)
def test_sft_step_time(benchmark, example: tuple, lora: bool, dtype: str) -> None:
    from transformers import AutoModelForCausalLM

    from birdtrain.config import ModelConfig
    from birdtrain.models import lora_config
    from birdtrain.stages.precision import cpu_bf16_supported

    if dtype == "bfloat16" and not cpu_bf16_supported():
        pytest.skip("this CPU has no native bfloat16 instructions")
    path, ids = example
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(ModelConfig(lora=True), model))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    model.train()

    def step() -> None:
        # As a trainer with bf16 on a CPU runs it: float32 weights, the passes under autocast.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # allocate the optimizer state outside the timing
    benchmark.pedantic(step, rounds=5, iterations=1)
    benchmark.extra_info.update(
        tokens=int(ids.shape[1]), trainable_parameters=sum(p.numel() for p in trainable)
    )

"""What sharing a group's prompt saves in a GRPO training pass: SmolLM2-135M on CPU, side by side.

A stage-3-shaped micro-batch: one real single-turn prompt (a gym-mini task, linked schema, no
sample rows: ~1.2k tokens of SmolLM2's tokenizer, as the ``smollm-learn`` preset renders it) and
``G`` completions of it, scored and back-propagated as the GRPO loss needs them. TRL's own pass
runs each whole sequence (prompt + completion); the shared pass
(``birdtrain.stages.shared_prompt``, ``stage3.share_prompt``/``stage4.share_prompt``) runs the
prompt once and the completions on its keys and values. Both give the same loss and gradient
(`tests/test_stages.py`); this measures the time. Run with
``pytest benchmarks/test_grpo_step.py --benchmark-only -m slow``; figures in benchmarks/README.md
("Shared prompts in GRPO").
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the train extra")

# Minutes each and gigabytes of memory on a 2-core CPU: outside the default benchmark set.
pytestmark = pytest.mark.slow

GROUP = 4  # completions of the prompt in one pass (the preset's micro-batches hold 2)
COMPLETION = 256  # tokens a completion (stage 3's mean in the second smollm-learn run: ~280)


@pytest.fixture(scope="module")
def batch() -> tuple:
    """``(model path, input_ids, attention_mask, completion width)`` in TRL's layout."""
    from birdtrain.config import load_config
    from birdtrain.data import load_train_tasks
    from birdtrain.models import load_tokenizer, resolve_model
    from birdtrain.prompts import single_turn_prompt

    path = resolve_model("smollm")
    tokenizer = load_tokenizer(path)
    cfg = load_config(preset="smollm-learn")
    task = load_train_tasks(cfg)[0]
    messages = [{"role": "user", "content": single_turn_prompt(task, cfg.prompt.options())}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    generator = torch.Generator().manual_seed(0)
    completions = torch.randint(100, len(tokenizer), (GROUP, COMPLETION), generator=generator)
    input_ids = torch.cat([torch.tensor([prompt]).expand(GROUP, -1), completions], dim=1)
    mask = torch.ones_like(input_ids)
    for row in range(GROUP):  # completions of different lengths, right-padded
        mask[row, len(prompt) + COMPLETION - 40 * row :] = 0
    return path, input_ids, mask, COMPLETION


@pytest.mark.parametrize("shared", [False, True], ids=["trl-full-pass", "shared-prompt"])
def test_grpo_pass_time(benchmark, batch: tuple, shared: bool) -> None:
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from birdtrain.stages.shared_prompt import shared_prompt_logps

    path, input_ids, mask, width = batch
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    model.train()
    scored = mask[:, -width:].bool()

    def full_pass() -> torch.Tensor:
        # TRL 1.16's GRPOTrainer._get_per_token_logps_and_entropies, one chunk
        labels = input_ids.masked_fill(mask == 0, -100)
        labels[:, :-width] = -100
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        return out.log_probs[:, -width:]

    def step() -> None:
        if shared:
            logps, _ = shared_prompt_logps(model, input_ids, mask, width, compute_entropy=True)
        else:
            logps = full_pass()
        (logps * scored).sum().backward()
        model.zero_grad()

    benchmark.pedantic(step, rounds=3, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(
        prompt_tokens=int(input_ids.shape[1] - width),
        group=GROUP,
        completion_tokens=int(scored.sum()),
        tokens_run=int(mask.sum())
        if not shared
        else int(input_ids.shape[1] - width + scored.sum()),
    )

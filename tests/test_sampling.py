"""The sampling rule every engine follows, on a checkpoint whose generation_config would change it:
only the temperature shapes the distribution, and every EOS id of the model ends a turn."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("trl", reason="TRL is in the train extra")

from birdtrain.models import build_tiny_model, load_policy
from birdtrain.policies import TransformersPolicy, eos_token_ids

# Sampling is what a transformers version changes: the vLLM lane runs these on its pins too.
pytestmark = pytest.mark.stack

PROMPT = [{"role": "user", "content": "SELECT name FROM customers WHERE city = NULL"}]


def _prompt_ids(tokenizer: Any) -> list[int]:
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _plain_logps(model: Any, ids: list[int], temperature: float) -> Any:
    """log softmax(logits / temperature) of the next token after every prefix of ``ids``."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return (logits / temperature).log_softmax(-1)


def _turn_logps(model: Any, context: list[int], ids: list[int], temperature: float) -> list[float]:
    """The plain-distribution logprob of each token of the turn ``ids`` after ``context``."""
    plain = _plain_logps(model, context + ids, temperature)
    return [float(plain[len(context) - 1 + k, t]) for k, t in enumerate(ids)]


@pytest.fixture(scope="module")
def opinionated(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """A tiny model whose generation_config sets a repetition penalty, top-k, min-p, and a second
    EOS id: the token it writes first, greedily, after the prompt. Returns (path, that id)."""
    path = build_tiny_model(tmp_path_factory.mktemp("opinionated"))
    model, tokenizer = load_policy(str(path))
    first = int(_plain_logps(model, _prompt_ids(tokenizer), 1.0)[-1].argmax())
    assert first != tokenizer.eos_token_id
    config = model.generation_config
    config.do_sample, config.repetition_penalty, config.top_k, config.min_p = True, 3.0, 3, 0.5
    config.eos_token_id = [tokenizer.eos_token_id, first]
    config.save_pretrained(path)
    return str(path), first


def test_every_eos_id_of_the_model_ends_a_turn(opinionated: tuple[str, int]) -> None:
    path, first = opinionated
    model, tokenizer = load_policy(path)
    policy = TransformersPolicy(model, tokenizer)
    assert policy.eos_ids == {tokenizer.eos_token_id, first}
    assert eos_token_ids(tokenizer, model.generation_config) == policy.eos_ids
    prompt = _prompt_ids(tokenizer)
    # Greedy under the plain distribution writes `first`, a declared EOS: the turn ends there.
    ((ids, logps),) = policy.generate([prompt], max_new_tokens=12, temperature=0.0)
    assert ids == [first]
    assert logps[0] == pytest.approx(float(_plain_logps(model, prompt, 1.0)[-1, first]), abs=1e-4)
    # The checkpoint's own settings are left as they were.
    assert model.generation_config.repetition_penalty == 3.0


def test_sampling_ignores_the_checkpoint_generation_config(opinionated: tuple[str, int]) -> None:
    """Sampled logprobs are those of softmax(logits / T): no penalty, top-k or min-p applied."""
    path, _ = opinionated
    model, tokenizer = load_policy(path)
    policy = TransformersPolicy(model, tokenizer)
    prompt = _prompt_ids(tokenizer)
    batch = [prompt, prompt[3:]]
    for context, (ids, logps) in zip(
        batch, policy.generate(batch, max_new_tokens=8, temperature=0.7), strict=True
    ):
        assert logps == pytest.approx(_turn_logps(model, context, ids, 0.7), abs=1e-4)


def test_a_repeated_context_is_read_once_and_sampled_as_alone(
    opinionated: tuple[str, int],
) -> None:
    """A batch that repeats contexts (a GRPO group) runs each distinct one once before sampling,
    and every row's tokens and logprobs are those of its own context (left padding included)."""
    import torch

    path, _ = opinionated
    model, tokenizer = load_policy(path)
    policy = TransformersPolicy(model, tokenizer)
    prompt = _prompt_ids(tokenizer)
    batch = [prompt, prompt[3:], prompt, prompt, prompt[3:]]
    read: list[tuple[int, ...]] = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: read.append(tuple(inputs[0].shape))
    )
    try:
        torch.manual_seed(0)
        samples = policy.generate(batch, max_new_tokens=8, temperature=0.7)
        torch.manual_seed(0)
        greedy = policy.generate(batch, max_new_tokens=8, temperature=0.0)
    finally:
        hook.remove()
    # the two distinct contexts, all but their last token, each once; then every row
    assert read[:3] == [(1, len(prompt) - 1), (1, len(prompt) - 4), (len(batch), 1)]
    for context, (ids, logps) in zip(batch, samples, strict=True):
        assert logps == pytest.approx(_turn_logps(model, context, ids, 0.7), abs=1e-4)
    alone = [policy.generate([c], max_new_tokens=8, temperature=0.0)[0][0] for c in batch[:2]]
    assert [ids for ids, _ in greedy] == [alone[0], alone[1], alone[0], alone[0], alone[1]]


def test_a_row_leaves_the_batch_when_its_turn_ends(opinionated: tuple[str, int]) -> None:
    """A row whose turn ended is no longer computed, and the others decode as transformers'
    own ``generate`` decodes them, greedily, token for token."""
    import torch
    from transformers import GenerationConfig

    path, first = opinionated
    model, tokenizer = load_policy(path)
    policy = TransformersPolicy(model, tokenizer)
    prompt = _prompt_ids(tokenizer)
    # The full prompt's greedy turn is `first`, an EOS: it ends after one token; the prompt cut
    # short by one or two tokens runs to the budget.
    batch = [prompt[:-1], prompt, prompt[:-2]]
    read: list[tuple[int, ...]] = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: read.append(tuple(inputs[0].shape))
    )
    try:
        turns = policy.generate(batch, max_new_tokens=10, temperature=0.0)
    finally:
        hook.remove()
    assert turns[1][0] == [first]
    assert [len(ids) for ids, _ in turns] == [10, 1, 10]
    assert read[3] == (3, 1)  # after the three contexts, their last tokens
    assert read[4:] == [(2, 1)] * 9  # from the second new token on, the two rows still going
    # generate fills every option it is not given from the checkpoint's (opinionated) config
    model.generation_config = GenerationConfig()
    for context, (ids, logps) in zip(batch, turns, strict=True):
        with torch.no_grad():
            reference = model.generate(
                input_ids=torch.tensor([context]),
                do_sample=False,
                max_new_tokens=10,
                eos_token_id=sorted(policy.eos_ids),
                pad_token_id=tokenizer.eos_token_id,
            )[0, len(context) :].tolist()
        assert ids == reference[: len(ids)] and (len(ids) == 10 or ids[-1] in policy.eos_ids)
        assert logps == pytest.approx(_turn_logps(model, context, ids, 1.0), abs=1e-4)


def test_a_rollouts_next_turn_reads_only_what_its_context_gained(
    opinionated: tuple[str, int],
) -> None:
    """Inside ``turns()`` a context that extends a row of the previous batch (its context, its turn,
    then the tool's answer) runs only the tokens added since; the turn is what a fresh read of the
    whole context gives. Outside the scope nothing is kept."""
    path, _ = opinionated
    model, tokenizer = load_policy(path)
    policy = TransformersPolicy(model, tokenizer)
    prompt = _prompt_ids(tokenizer)
    answer = prompt[2:9]  # stands for the tool's answer and the template around it
    read: list[tuple[int, ...]] = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: read.append(tuple(inputs[0].shape))
    )
    try:
        with policy.turns():
            first = policy.generate([prompt[:-1], prompt[:-2]], max_new_tokens=4, temperature=0.0)
            second_turn = [
                c + ids + answer
                for c, (ids, _) in zip([prompt[:-1], prompt[:-2]], first, strict=True)
            ]
            read.clear()
            second = policy.generate(second_turn, max_new_tokens=4, temperature=0.0)
            reused = list(read)
        read.clear()
        fresh = policy.generate(second_turn, max_new_tokens=4, temperature=0.0)
    finally:
        hook.remove()
    # each row's last sampled token (never fed) and the answer but its last token, then decoding
    assert reused[:3] == [(1, len(answer)), (1, len(answer)), (2, 1)]
    assert read[:2] == [(1, len(second_turn[0]) - 1), (1, len(second_turn[1]) - 1)]
    for (ids, logps), (fresh_ids, fresh_logps) in zip(second, fresh, strict=True):
        assert ids == fresh_ids
        assert logps == pytest.approx(fresh_logps, abs=1e-4)

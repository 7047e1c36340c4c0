"""Stages 1-3 on TRL with the offline tiny model, and the reward functions, on real episodes.

The tasks live on the small ``shop`` database of ``conftest``: its prompts are ~1k tokens of the
tiny model's tokenizer, where a gym-mini prompt is ~4.7k and a gym-mini trajectory ~6.5k, which
makes one SFT step ~40x slower on two cores (measured: 9 s a step at batch 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from birdenv.agents import OracleAgent, run_episode
from birdenv.envs.critic import BirdCriticEnv
from birdenv.schema import PromptOptions
from birdenv.tasks import Task, load_tasks
from birdenv.tools import TOOL_SCHEMAS, has_tool_call
from birdtrain.config import CurriculumConfig, load_config
from birdtrain.sampling import read_groups
from tests.conftest import SHOP_TASKS, build_shop

pytestmark = pytest.mark.long  # conftest.py: started first

pytest.importorskip("trl", reason="TRL is in the train extra")

# More real tasks on the shop database: every issue SQL fails its test, every gold passes.
MORE_SHOP_TASKS: list[dict[str, Any]] = [
    {
        "instance_id": "shop_4",
        "db_id": "shop",
        "category": "Query",
        "query": "Number of orders per city; my counts look wrong.",
        "issue_sql": [
            "SELECT city, COUNT(*) FROM customers JOIN orders ON customers.id = orders.id GROUP BY city"
        ],
        "sol_sql": [
            "SELECT city, COUNT(*) FROM customers JOIN orders ON customers.id = orders.customer_id GROUP BY city"
        ],
    },
    {
        "instance_id": "shop_5",
        "db_id": "shop",
        "category": "Query",
        "query": "Which orders were placed in February 2023? I get nothing back.",
        "issue_sql": ["SELECT id FROM orders WHERE placed_at LIKE '2023-2-%'"],
        "sol_sql": ["SELECT id FROM orders WHERE placed_at LIKE '2023-02-%'"],
    },
    {
        "instance_id": "shop_6",
        "db_id": "shop",
        "category": "Query",
        "query": "Average order total where a missing total counts as zero.",
        "issue_sql": ["SELECT AVG(total) FROM orders"],
        "sol_sql": ["SELECT AVG(COALESCE(total, 0)) FROM orders"],
    },
    {
        "instance_id": "shop_7",
        "db_id": "shop",
        "category": "Query",
        "query": "Customers who joined during 2021; my query also returns later ones.",
        "issue_sql": ["SELECT name FROM customers WHERE joined > '2021'"],
        "sol_sql": ["SELECT name FROM customers WHERE joined LIKE '2021-%'"],
    },
    {
        "instance_id": "shop_8",
        "db_id": "shop",
        "category": "Query",
        "query": "Names of customers who placed an order above 100.",
        "issue_sql": ["SELECT name FROM customers WHERE id IN (SELECT id FROM big_orders)"],
        "sol_sql": ["SELECT name FROM customers WHERE id IN (SELECT customer_id FROM big_orders)"],
    },
    {
        "instance_id": "shop_9",
        "db_id": "shop",
        "category": "Query",
        "query": "How much has Ann spent in total? I get NULL.",
        "issue_sql": ["SELECT SUM(total) FROM orders WHERE customer_id = 'Ann'"],
        "sol_sql": [
            "SELECT SUM(o.total) FROM orders o JOIN customers c ON c.id = o.customer_id WHERE c.name = 'Ann'"
        ],
    },
    {
        "instance_id": "shop_10",
        "db_id": "shop",
        "category": "Management",
        "query": "Delete the customers who never ordered; my delete removes nobody.",
        "preprocess_sql": ["INSERT INTO customers VALUES (4, 'Dee', 'Oslo', '2023-05-01')"],
        "issue_sql": ["DELETE FROM customers WHERE id NOT IN (SELECT id FROM orders)"],
        "sol_sql": ["DELETE FROM customers WHERE id NOT IN (SELECT customer_id FROM orders)"],
        "test_cases": [
            "def test_case(pred_sqls, sol_sqls, db_path, conn, conditions):\n"
            "    res, err, to = execute_queries(['SELECT name FROM customers ORDER BY id'], db_path, conn, None, '')\n"
            "    assert not err and [r[0] for r in res] == ['Ann', 'Bob', 'Cid'], res\n"
            "    return 1\n"
        ],
    },
]


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> list[Task]:
    """Ten real tasks on the shop database, through the public loader."""
    root = tmp_path_factory.mktemp("shop")
    build_shop(root / "dbs")
    path = root / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in SHOP_TASKS + MORE_SHOP_TASKS))
    return load_tasks(path, db_dir=root / "dbs")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The offline tiny Qwen3 (random weights, TRL's Qwen3 chat template)."""
    from birdtrain.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def episodes(shop: list[Task]) -> dict[str, dict[str, Any]]:
    """Stage-2 examples: the oracle's real episodes, kept only when the judge accepted them."""
    env = BirdCriticEnv(tasks=shop)
    out = {}
    for task in shop:
        reward, info = run_episode(env, OracleAgent(), task.instance_id)
        assert reward == 1.0, task.instance_id
        out[task.instance_id] = {
            "messages": info["messages"],
            "tools": TOOL_SCHEMAS,
            "task_id": task.instance_id,
        }
    env.close()
    return out


def _cfg(**overrides: Any) -> CurriculumConfig:
    items = [f"{k}={v}" for k, v in overrides.items()]
    return load_config(
        "smoke", overrides=["stage1.max_length=2048", "stage2.max_length=4096", *items]
    )


def _gold_answers(tasks: list[Task]) -> list[dict[str, Any]]:
    """Stage-1 examples: each task's single-turn prompt answered with its gold SQL."""
    from birdtrain.prompts import format_answer, single_turn_prompt

    return [
        {
            "prompt": [{"role": "user", "content": single_turn_prompt(t)}],
            "completion": [
                {"role": "assistant", "content": format_answer("Fix the SQL.", list(t.sol_sql))}
            ],
            "task_id": t.instance_id,
        }
        for t in tasks
    ]


def test_shop_tasks_are_valid(shop: list[Task]) -> None:
    from birdenv.judge import judge

    for task in shop:
        assert judge(task, task.sol_sql).passed, task.instance_id
        assert not judge(task, task.issue_sql).passed, task.instance_id


# -- (a) stage 2 trains on assistant turns only ----------------------------------------------
@pytest.mark.stack
def test_stage2_labels_only_assistant_turns(episodes: dict, tiny: str, tmp_path: Path) -> None:
    from birdtrain.stages import sft

    examples = [episodes["shop_1"], episodes["shop_2"]]
    trainer = sft.build_trainer(
        _cfg(**{"stage2.turns": "whole"}),
        model_path=tiny,
        out_dir=tmp_path,
        examples=examples,
        stage=2,
    )
    tokenizer = trainer.processing_class
    assert len(trainer.train_dataset) == 2
    for row, example in zip(trainer.train_dataset, examples, strict=True):
        ids, labels = row["input_ids"], row["labels"]
        # Contiguous labelled spans, decoded: each must be one assistant turn and its end token.
        spans, current = [], []
        for token, label in zip(ids, labels, strict=True):
            if label == -100:
                if current:
                    spans.append(tokenizer.decode(current))
                current = []
            else:
                assert label == token
                current.append(token)
        if current:
            spans.append(tokenizer.decode(current))
        assistant = [m["content"] for m in example["messages"] if m["role"] == "assistant"]
        assert len(spans) == len(assistant)
        for span, content in zip(spans, assistant, strict=True):
            # The Qwen3 template opens each assistant turn with an empty think block (the model
            # emits it at inference too); then the turn's text and its end-of-turn token.
            before, found, after = span.partition(content)
            assert found and before.strip() in ("", "<think>\n\n</think>"), (span, content)
            assert after.strip() == "<|im_end|>"
        # Every user and tool token is -100: none of their text is in the labelled spans.
        labelled = "".join(spans)
        for message in example["messages"]:
            if message["role"] != "assistant":
                assert message["content"] not in labelled
        assert "<tool_response>" not in labelled and "# Database Schema" not in labelled
        assert sum(label != -100 for label in labels) < len(labels) / 4


def test_stage2_per_turn_examples_label_one_turn_in_its_stage4_context(
    shop: list[Task], tiny: str, tmp_path: Path
) -> None:
    """``stage2.turns=each``: one example per assistant turn of the expert's real trajectories.

    The unlabelled part of each example is token for token the context stage 4 generates that
    turn from (``rollout.prompt_ids`` of the messages before it); the labelled part is that turn
    and its end-of-turn token, nothing else.
    """
    from birdtrain.data.tool_use import build_tool_trajectories
    from birdtrain.rollout import prompt_ids
    from birdtrain.stages import sft
    from birdtrain.stages.sft import turn_examples

    trajectories = build_tool_trajectories(shop[:2], max_turns=4, progress=False)
    assert len(trajectories) == 2
    turns = turn_examples(trajectories)
    assistant = [
        (i, m)
        for i, t in enumerate(trajectories)
        for m in t["messages"]
        if m["role"] == "assistant"
    ]
    assert len(turns) == len(assistant) and len(turns) > 2
    for example, (i, message) in zip(turns, assistant, strict=True):
        # the env's own message objects: byte for byte what stage 4 and evaluation see
        assert example["completion"] == [message]
        k = trajectories[i]["messages"].index(message)
        assert example["prompt"] == trajectories[i]["messages"][:k]

    # turns="first": only the opening turn of each trajectory, in the same form
    openings = sft.build_dataset(trajectories, 2, turns="first")
    assert [row["completion"][0]["content"] for row in openings] == [
        next(m["content"] for m in t["messages"] if m["role"] == "assistant") for t in trajectories
    ]
    assert all(len(row["prompt"]) == 1 for row in openings)

    trainer = sft.build_trainer(
        _cfg(**{"stage2.turns": "each"}),
        model_path=tiny,
        out_dir=tmp_path,
        examples=trajectories,
        stage=2,
    )
    tokenizer = trainer.processing_class
    assert len(trainer.train_dataset) == len(turns)
    for row, example in zip(trainer.train_dataset, turns, strict=True):
        ids, labels = row["input_ids"], row["labels"]
        start = next(j for j, label in enumerate(labels) if label != -100)
        assert all(label != -100 for label in labels[start:])  # one contiguous span, to the end
        assert ids[:start] == prompt_ids(tokenizer, example["prompt"])
        text = tokenizer.decode(ids[start:])
        before, found, after = text.partition(example["completion"][0]["content"])
        assert found and before.strip() in ("", "<think>\n\n</think>"), text
        assert after.strip() == "<|im_end|>"


def test_stage2_turns_sit_in_the_context_rollouts_build(
    shop: list[Task], tiny: str, tmp_path: Path
) -> None:
    """From turn 2 on, a supervised turn's context is the one a rollout builds: the prompt, then
    each earlier turn as the model emits it (the template's ``<think>`` block included), then the
    template's tool block. Qwen3's own template drops the block from earlier turns."""
    from birdtrain.data.tool_use import build_tool_trajectories
    from birdtrain.rollout import prompt_ids, tool_suffix_ids
    from birdtrain.stages import sft

    trajectories = build_tool_trajectories(shop[:2], max_turns=4, progress=False)
    trainer = sft.build_trainer(
        _cfg(**{"stage2.turns": "each"}),
        model_path=tiny,
        out_dir=tmp_path,
        examples=trajectories,
        stage=2,
    )
    tokenizer = trainer.processing_class
    rows = iter(trainer.train_dataset)
    checked = 0
    for trajectory in trajectories:
        messages = trajectory["messages"]
        context = prompt_ids(tokenizer, messages[:1])
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            row = next(rows)
            start = next(j for j, label in enumerate(row["labels"]) if label != -100)
            assert row["input_ids"][:start] == context, f"turn {k} sits in another context"
            checked += k > 1
            turn = row["input_ids"][start:]
            turn = turn[: turn.index(tokenizer.eos_token_id) + 1]  # what the model emits
            if k + 1 < len(messages):
                suffix = tool_suffix_ids(tokenizer, messages[: k + 2], turn_ended_with_eos=True)
                context = context + turn + suffix
    assert checked >= 2  # later turns were compared, not only openings


def test_stage2_turns_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="'each', 'first' or 'whole'"):
        load_config("smoke", overrides=["stage2.turns=some"])


def test_sft_refuses_a_max_length_that_cuts_every_assistant_turn(
    episodes: dict, tiny: str, tmp_path: Path
) -> None:
    from birdtrain.stages import sft

    with pytest.raises(ValueError, match="max_length"):
        sft.build_trainer(
            _cfg(**{"stage2.max_length": 64}),
            model_path=tiny,
            out_dir=tmp_path,
            examples=[episodes["shop_1"]],
            stage=2,
        )


@pytest.mark.stack
def test_stage1_labels_only_the_completion(shop: list[Task], tiny: str, tmp_path: Path) -> None:
    from birdtrain.prompts import format_answer, single_turn_prompt
    from birdtrain.stages import sft

    task = shop[0]
    answer = format_answer("The filter compares with NULL.", list(task.sol_sql))
    example = {
        "prompt": [{"role": "user", "content": single_turn_prompt(task)}],
        "completion": [{"role": "assistant", "content": answer}],
        "task_id": task.instance_id,
    }
    trainer = sft.build_trainer(
        _cfg(**{"model.gradient_checkpointing": True}),
        model_path=tiny,
        out_dir=tmp_path,
        examples=[example],
        stage=1,
    )
    row = trainer.train_dataset[0]
    labelled = [
        t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != -100
    ]
    text = trainer.processing_class.decode(labelled)
    assert answer in text and "# Database Schema" not in text and "<|im_start|>user" not in text
    # The model setting decides whether TRL checkpoints activations, either way.
    assert trainer.args.gradient_checkpointing is True
    lean = sft.build_trainer(
        _cfg(**{"model.gradient_checkpointing": False}),
        model_path=tiny,
        out_dir=tmp_path,
        examples=[example],
        stage=1,
    )
    assert lean.args.gradient_checkpointing is False


def test_sft_warns_of_targets_longer_than_the_later_generation_limit(
    shop: list[Task], episodes: dict, tiny: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer or turn longer than what stage 3/4 and evaluation may generate is cut there
    every time: building the SFT trainer says how many, against which limits."""
    from birdtrain.stages import sft

    def warnings(stage: int, examples: list, **limits: Any) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="birdtrain.stages.sft"):
            sft.build_trainer(
                _cfg(**limits), model_path=tiny, out_dir=tmp_path, examples=examples, stage=stage
            )
        return [r.getMessage() for r in caplog.records if "longer than" in r.getMessage()]

    answers, n = _gold_answers(shop), len(shop)
    roomy = {"stage3.max_completion_length": 512, "eval.max_new_tokens": 512}
    assert warnings(1, answers, **roomy) == []
    (said,) = warnings(
        1,
        answers,
        **{
            "stage3.max_completion_length": 8,
            "eval.max_new_tokens": 200,
            "eval.modes": "[agent,single]",
        },
    )
    assert said.startswith(f"stage 1: {n} of {n} trained answers are longer than the 8 tokens")
    assert "stage3.max_completion_length=8, eval.max_new_tokens=200" in said
    assert "data.thought_rows" in said
    # A disabled stage and an evaluation without single-turn mode set no limit.
    assert (
        warnings(
            1,
            answers,
            **{"stage3.max_completion_length": 8, "stage3.enabled": False, "eval.modes": "[agent]"},
        )
        == []
    )
    # Stage 2: every assistant turn is a span of its own, held against stage 4's limit.
    trajectory = episodes["shop_1"]
    turns = sum(m["role"] == "assistant" for m in trajectory["messages"])
    (said,) = warnings(2, [trajectory], **{"stage2.turns": "whole", "stage4.max_new_tokens": 4})
    assert said.startswith(f"stage 2: {turns} of {turns} trained assistant turns are longer")
    assert "stage4.max_new_tokens=4" in said


# -- (b) stage 2 teaches the tiny model to call tools, on prompts it never saw ------------------
#: The prompts of the stage-2 tests: the full schema without its sample rows, which were most of
#: the tokens the tiny model trained on and taught it nothing.
NO_ROWS = PromptOptions(sample_rows=False)


def _rollout_first_turns(model_path: str, task_ids: list[str]) -> list[str]:
    """Greedy first assistant turn on each critic-mini task, through the stage-4 rollout path.

    ``birdtrain.rollout.collect`` over a real vector env of BirdCriticEnv: the env renders the
    prompt, ``rollout.prompt_ids`` the chat template, ``TransformersPolicy`` generates (batched,
    left-padded), and the turn is stepped into the environment.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from birdenv.vector import make_vec
    from birdtrain.policies import TransformersPolicy
    from birdtrain.rollout import VECTOR_KWARGS, collect

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    envs = make_vec(
        len(task_ids),
        suite="critic-mini",
        asynchronous=False,
        vector_kwargs=VECTOR_KWARGS,
        prompt_options=NO_ROWS,
    )
    try:
        rollouts = collect(
            envs,
            TransformersPolicy(model, tokenizer),
            task_ids,
            num_generations=1,
            max_turns=1,
            max_new_tokens=96,
            temperature=0.0,
            max_context=8192,
        )
    finally:
        envs.close()
    turns = []
    for traj in rollouts:
        assert not traj.dropped, traj.error
        assert traj.turns == 1 and traj.tool_calls + traj.invalid_calls == 1
        assistant = [m["content"] for m in traj.messages if m["role"] == "assistant"]
        turns.append(assistant[0] if assistant else "")
    return turns


def test_stage2_teaches_tool_calls_on_unseen_tasks(tmp_path: Path) -> None:
    """After stage 2 the tiny model opens held-out episodes with a well-formed tool call.

    Training data: the offline expert's real trajectories (``build_tool_trajectories``) on four
    gym-mini tasks, cut to their first exchange (user prompt, first assistant turn: the one that
    opens every episode) so that ~20 CPU steps suffice. Evaluation: critic-mini tasks, another
    suite with other databases, never trained on, through the rollout path stage 4 uses. The
    untrained model emits no valid call on them. Measured on 2 cores: 20 steps, ~60-90 s in all.
    """
    from birdenv import load_tasks as load_suite
    from birdtrain.data.tool_use import build_tool_trajectories
    from birdtrain.models import resolve_model
    from birdtrain.stages import sft

    base = resolve_model("tiny", cache=tmp_path / "models")
    train = build_tool_trajectories(
        load_suite("gym-mini")[:4], max_turns=4, progress=False, prompt=NO_ROWS
    )
    assert len(train) == 4
    examples = [dict(e, messages=e["messages"][:2]) for e in train]
    held_out = [t.instance_id for t in load_suite("critic-mini")[:6]]
    assert not {e["task_id"] for e in train} & set(held_out)

    before = _rollout_first_turns(base, held_out)
    assert not any(has_tool_call(turn) for turn in before), before

    cfg = load_config(
        "smoke",
        overrides=[
            "stage2.max_steps=20",
            "stage2.learning_rate=3e-3",
            "stage2.batch_size=2",
            "stage2.per_device_batch_size=2",
            "stage2.warmup_ratio=0",
            "stage2.max_length=4096",
        ],
    )
    checkpoint = sft.run(cfg, model_path=base, out_dir=tmp_path / "s2", examples=examples, stage=2)
    after = _rollout_first_turns(str(checkpoint), held_out)
    assert all(has_tool_call(turn) for turn in after), after
    metrics = [json.loads(x) for x in (tmp_path / "s2/metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 20 and losses[-1] < losses[0] / 2


def test_an_interrupted_stage_resumes_from_its_last_checkpoint(
    shop: list[Task], tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stage stopped after an intermediate checkpoint resumes there when rerun, and ends where
    an uninterrupted run ends: same steps, same losses, same weights. A checkpoint whose save was
    cut short (the process killed while writing it) is passed over."""
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback

    from birdtrain.stages import sft
    from birdtrain.stages.training import train

    examples = _gold_answers(shop[:6])
    cfg = _cfg(**{"stage1.max_steps": 3, "stage1.save_steps": 1, "stage1.learning_rate": 1e-3})

    class Killed(Exception):
        pass

    class KillAfterSecondSave(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:
                raise Killed

    interrupted = sft.build_trainer(
        cfg, model_path=tiny, out_dir=tmp_path / "a", examples=examples, stage=1
    )
    interrupted.add_callback(KillAfterSecondSave())
    with pytest.raises(Killed):
        train(interrupted)
    assert [p.name for p in (tmp_path / "a/trainer").glob("checkpoint-*")] == ["checkpoint-2"]
    # A later save killed midway: its folder holds part of the weights and no trainer state.
    cut = tmp_path / "a/trainer/checkpoint-3"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(
        (tmp_path / "a/trainer/checkpoint-2/model.safetensors").read_bytes()[:4096]
    )

    capsys.readouterr()
    resumed = sft.run(cfg, model_path=tiny, out_dir=tmp_path / "a", examples=examples, stage=1)
    out = capsys.readouterr().out
    assert f"{cut} was not written to its end" in out
    assert f"resuming from {tmp_path / 'a/trainer/checkpoint-2'}" in out
    straight = sft.run(cfg, model_path=tiny, out_dir=tmp_path / "b", examples=examples, stage=1)

    def losses(run: str) -> dict[int, float]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return {m["step"]: m["loss"] for m in map(json.loads, lines) if "loss" in m}

    assert list(losses("a")) == [1, 2, 3]
    assert losses("a") == pytest.approx(losses("b"), rel=1e-4)
    a = AutoModelForCausalLM.from_pretrained(resumed).state_dict()
    b = AutoModelForCausalLM.from_pretrained(straight).state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in b)
    start = AutoModelForCausalLM.from_pretrained(tiny).state_dict()
    assert not all(torch.equal(start[k], b[k]) for k in b)  # it trained


@pytest.mark.stack
def test_bfloat16_on_a_cpu_trains_and_samples_under_autocast(
    shop: list[Task], tiny: str, tmp_path: Path
) -> None:
    """``model.dtype=bfloat16`` on a CPU with native bfloat16: the trainer's forward passes and the
    stage's sampler compute in bfloat16 (CPU autocast), while the trained weights stay float32.
    Without native instructions the same setting computes in float32, a LoRA base included
    (emulated bfloat16 is far slower than float32)."""
    import torch

    from birdtrain.stages import sft
    from birdtrain.stages.precision import cpu_bf16_supported, training_precision
    from birdtrain.stages.training import stage_actor

    assert training_precision("bfloat16", lora=False, cuda=False, bf16_supported=False) == (
        training_precision("float32", lora=False, cuda=False)
    )
    # Emulated half precision is far slower than float32: a LoRA base is float32 there too.
    for half in ("bfloat16", "float16"):
        precision = training_precision(half, lora=True, cuda=False, bf16_supported=False)
        assert (precision.weights, precision.compute) == ("float32", "float32")
    precision = training_precision("bfloat16", lora=True, cuda=False, bf16_supported=True)
    assert (precision.weights, precision.compute) == ("bfloat16", "bfloat16")
    precision = training_precision("bfloat16", lora=False, cuda=False, bf16_supported=True)
    assert (precision.weights, precision.compute) == ("float32", "bfloat16")
    if not cpu_bf16_supported():
        pytest.skip("this CPU has no native bfloat16 instructions")

    cfg = _cfg(**{"model.dtype": "bfloat16", "stage1.max_steps": 2, "stage1.learning_rate": 1e-3})
    trainer = sft.build_trainer(
        cfg, model_path=tiny, out_dir=tmp_path, examples=_gold_answers(shop[:4]), stage=1
    )
    assert trainer.args.use_cpu and trainer.args.bf16
    computed: list[torch.dtype] = []
    layer = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))
    layer.register_forward_hook(lambda module, inputs, output: computed.append(output.dtype))
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert computed and set(computed) == {torch.bfloat16}
    weights = trainer.model.state_dict()
    assert {v.dtype for v in weights.values()} == {torch.float32}
    assert not all(torch.equal(start[k], weights[k]) for k in start)  # it trained

    computed.clear()
    sampler = stage_actor(trainer)
    ids = trainer.processing_class("SELECT 1")["input_ids"]
    ((tokens, logps),) = sampler.generate([ids], max_new_tokens=3, temperature=0)
    assert computed and set(computed) == {torch.bfloat16}
    assert len(tokens) == len(logps) >= 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_vllm_weight_sync_merges_out_of_place(tiny: str, dtype: str) -> None:
    """What the weight sync sends vLLM for a LoRA model: each adapted weight merged as peft's
    ``merge_and_unload`` merges it, while the frozen base (also the KL reference) keeps every bit,
    on a float32 base as on a bfloat16 one. (On a float32 base the merge once summed into the
    base itself, adding the adapters to it at every sync.)"""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from birdtrain.stages.weight_sync import merged_named_params

    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=getattr(torch, dtype))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)  # peft starts B at zero: a merge would change nothing
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}

    synced = dict(merged_named_params(model, rename=lambda name: name))

    after = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    assert all(torch.equal(after[n], before[n]) for n in before)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    frozen = {
        n.removeprefix("base_model.model.").replace(".base_layer", ""): p for n, p in before.items()
    }
    adapted = [n for n in synced if ".q_proj." in n or ".down_proj." in n]
    assert adapted and synced.keys() <= merged.keys()
    assert all(synced[n].dtype == getattr(torch, dtype) for n in synced)
    assert all(torch.allclose(synced[n], merged[n], rtol=1e-2, atol=1e-2) for n in adapted)
    assert all(not torch.equal(synced[n], frozen[n]) for n in adapted)


@pytest.mark.parametrize("half", [False, True])
def test_a_lora_checkpoint_is_merged_out_of_place(tiny: str, tmp_path: Path, half: bool) -> None:
    """A LoRA stage's checkpoint holds what peft's ``merge_and_unload`` and ``save_pretrained``
    would write (every weight, the config), in the trainer's half dtype under mixed precision,
    written a shard at a time with its index, while the trainer's model stays unmerged."""
    import copy
    from types import SimpleNamespace

    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from birdtrain.stages.outputs import save_checkpoint, save_merged

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny), LoraConfig(r=4, target_modules=["q_proj"])
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)  # peft starts B at zero: a merge would change nothing
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dtype = torch.bfloat16 if half else torch.float32
    reference = copy.deepcopy(model).merge_and_unload().to(dtype)
    reference.save_pretrained(tmp_path / "reference")
    args = SimpleNamespace(bf16=half, fp16=False)
    save_checkpoint(model, AutoTokenizer.from_pretrained(tiny), tmp_path / "one", args=args)
    total = sum(p.nbytes for p in reference.state_dict().values())
    save_merged(model, tmp_path / "shards", dtype=dtype if half else None, shard_bytes=total // 3)

    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    expected = json.loads((tmp_path / "reference/config.json").read_text())
    assert [p.name for p in (tmp_path / "one").glob("*.safetensors")] == ["model.safetensors"]
    shards = sorted(p.name for p in (tmp_path / "shards").glob("*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "shards/model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    for folder in ("one", "shards"):
        assert json.loads((tmp_path / folder / "config.json").read_text()) == expected
        saved: dict[str, Any] = {}
        for file in (tmp_path / folder).glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                assert f.metadata() == {"format": "pt"}
                saved |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        loaded, info = AutoModelForCausalLM.from_pretrained(
            tmp_path / folder, output_loading_info=True
        )
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        want = reference.state_dict()
        assert saved.keys() <= want.keys() and loaded.state_dict().keys() == want.keys()
        assert all(saved[k].dtype == dtype and torch.equal(saved[k], want[k]) for k in saved)
        assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


def test_save_steps_is_checked() -> None:
    with pytest.raises(ValueError, match="save_steps must be >= 0"):
        _cfg(**{"stage4.save_steps": -1})


# -- (c) stages 1 and 3 end to end --------------------------------------------------------------
@pytest.mark.stack
def test_stage1_then_stage3_end_to_end(shop: list[Task], tiny: str, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from birdtrain.stages import grpo, sft

    examples = _gold_answers(shop[:4])
    cfg = _cfg(
        **{
            "stage1.max_steps": 2,
            "stage3.max_steps": 2,
            "stage3.max_completion_length": 12,
            "stage3.max_prompt_length": 2048,
        }
    )
    stage1 = sft.run(cfg, model_path=tiny, out_dir=tmp_path / "s1", examples=examples, stage=1)
    stage3 = grpo.run(cfg, model_path=str(stage1), out_dir=tmp_path / "s3", tasks=shop[:4])
    start = AutoModelForCausalLM.from_pretrained(tiny).state_dict()
    for checkpoint in (stage1, stage3):
        model, info = AutoModelForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
        # Every weight comes from the checkpoint: none missing, none left over, none reshaped...
        problems = {k: info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        assert not any(problems.values()), problems
        weights = model.state_dict()
        saved: dict[str, Any] = {}
        for path in sorted(Path(checkpoint).glob("*.safetensors")):
            saved |= load_file(path)
        assert saved and all(torch.equal(weights[k], saved[k]) for k in saved)
        # ...and they are the trained weights, not the tiny model's.
        assert weights.keys() == start.keys()
        assert not all(torch.equal(weights[k], start[k]) for k in start)
        assert AutoTokenizer.from_pretrained(checkpoint).chat_template
    s1 = [json.loads(x) for x in (tmp_path / "s1/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in s1 if "loss" in m] == [1, 2]
    assert {"step", "loss", "learning_rate", "mean_token_accuracy"} <= set(s1[0])
    s3 = [json.loads(x) for x in (tmp_path / "s3/metrics.jsonl").read_text().splitlines()]
    steps = [m for m in s3 if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert {"loss", "learning_rate", "reward_mean", "reward_std", "pass_rate", "kl"} <= set(m)
        assert 0.0 <= m["pass_rate"] <= 1.0
        assert "rewards/format_reward/mean" in m
        # groups.jsonl holds the step's own draw, group by group, as metrics.jsonl averages it.
        draw = [
            r for step, _, r in read_groups(tmp_path / "s3" / "groups.jsonl") if step == m["step"]
        ]
        assert len(draw) == m["sampling/groups"] == cfg.stage3.prompts_per_step
        assert sum(draw) / len(draw) == pytest.approx(m["sampling/reward_before"])
    assert not any(p.name not in {"s1", "s3"} for p in tmp_path.iterdir())


@pytest.mark.stack
@pytest.mark.parametrize(
    ("stage", "lora"), [("stage3", False), ("stage4", False), ("stage3", True)]
)
def test_shared_prompt_scores_as_trls_full_pass(
    stage: str, lora: bool, shop: list[Task], tiny: str, tmp_path: Path
) -> None:
    """A stage's trainer scores a batch (two real prompts of different lengths, left-padded, and
    completions right-padded) with the same log-probabilities, entropies and gradient as TRL's own
    pass over every whole sequence, LoRA adapters included; with share_prompt off it is TRL's
    trainer."""
    import torch
    from trl import GRPOTrainer

    from birdtrain.prompts import single_turn_prompt

    # No LoRA dropout: its random masks would make any two passes' gradients differ.
    cfg = _cfg(
        **{
            f"{stage}.max_steps": 1,
            "stage3.max_prompt_length": 4096,
            "model.lora": lora,
            "model.lora_dropout": 0.0,
        }
    )
    trainer = _rl_trainer(cfg, stage, tiny, tmp_path, shop[:2])
    assert type(trainer) is not GRPOTrainer and isinstance(trainer, GRPOTrainer)
    tokenizer = trainer.processing_class
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": single_turn_prompt(t, cfg.prompt.options())}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for t in (shop[0], shop[6])
    ]
    assert len(prompts[0]) != len(prompts[1])
    width, completion = max(map(len, prompts)), 9
    generator = torch.Generator().manual_seed(0)
    rows, masks = [], []
    for i, lengths in enumerate([(9, 4, 1), (7, 9, 2)]):  # three completions of each prompt
        for n in lengths:
            pad = width - len(prompts[i])
            ids = torch.randint(10, len(tokenizer), (completion,), generator=generator)
            rows.append(
                torch.cat([torch.zeros(pad, dtype=torch.long), torch.tensor(prompts[i]), ids])
            )
            masks.append(
                torch.tensor([0] * pad + [1] * len(prompts[i]) + [1] * n + [0] * (completion - n))
            )
    order = [0, 3, 1, 4, 2, 5]  # interleaved, as TRL shuffles a step's batch
    input_ids, attention_mask = torch.stack(rows)[order], torch.stack(masks)[order]
    scored = attention_mask[:, -completion:].bool()
    weights = torch.randn(len(order), completion, generator=generator)
    results = []
    for method in (
        trainer._get_per_token_logps_and_entropies,
        GRPOTrainer._get_per_token_logps_and_entropies.__get__(trainer),
    ):
        trainer.model.zero_grad()
        logps, entropies, _ = method(
            trainer.model, input_ids, attention_mask, completion, batch_size=4, compute_entropy=True
        )
        (logps * weights * scored).sum().backward()
        grads = torch.cat(
            [p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]
        )
        results.append((logps[scored], entropies[scored], grads))
    (shared, shared_entropy, shared_grad), (full, full_entropy, full_grad) = results
    assert torch.allclose(shared, full, atol=1e-5), (shared - full).abs().max()
    assert torch.allclose(shared_entropy, full_entropy, atol=1e-5)
    # float32 rounding of sums taken in another order: ~1e-6 of the gradient's size
    error = float((shared_grad - full_grad).norm() / full_grad.norm())
    assert error < 1e-5, error
    assert full_grad.abs().max() > 0

    cfg = _cfg(**{f"{stage}.share_prompt": False, "stage3.max_prompt_length": 4096})
    assert type(_rl_trainer(cfg, stage, tiny, tmp_path, shop[:2])) is GRPOTrainer


def _rl_trainer(cfg: Any, stage: str, model: str, out_dir: Path, tasks: list[Task]) -> Any:
    """Stage 3's or stage 4's trainer as the stage builds it (stage 4 over real envs)."""
    from birdenv.vector import make_vec
    from birdtrain.rollout import VECTOR_KWARGS
    from birdtrain.stages import agentic, grpo

    if stage == "stage3":
        return grpo.build_trainer(cfg, model_path=model, out_dir=out_dir, tasks=tasks)
    envs = make_vec(2, tasks=tasks, asynchronous=False, vector_kwargs=VECTOR_KWARGS)
    envs.close()  # the trainer is inspected, never run
    return agentic.build_trainer(cfg, model_path=model, out_dir=out_dir, tasks=tasks, envs=envs)


def test_grpo_refuses_prompts_that_are_all_too_long(shop: list[Task], tiny: str) -> None:
    from transformers import AutoTokenizer

    from birdtrain.stages import grpo

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert len(grpo.build_dataset(shop[:2], tokenizer, None)) == 2
    with pytest.raises(ValueError, match="max_prompt_length"):
        grpo.build_dataset(shop[:2], tokenizer, 16)


# -- (d) reward functions on real completions ----------------------------------------------------
def test_rewards_on_real_completions(shop: list[Task]) -> None:
    from birdtrain.prompts import format_answer
    from birdtrain.rewards import format_reward, get_reward, solution_reward

    by_id = {t.instance_id: t for t in shop}
    ids = ["shop_1", "shop_2", "shop_10", "shop_1", "shop_2", "shop_10"]
    completions = [
        [{"role": "assistant", "content": format_answer("Use IS NULL.", list(by_id[i].sol_sql))}]
        for i in ids[:3]
    ] + [
        [{"role": "assistant", "content": format_answer("Looks fine.", list(by_id[i].issue_sql))}]
        for i in ids[3:]
    ]
    prompts = [[{"role": "user", "content": "..."}]] * len(ids)
    assert solution_reward(prompts, completions, task_id=ids, tasks=by_id) == [1.0] * 3 + [0.0] * 3
    garbage = ["", "SELECT name FROM customers", "<solution>```sql\nDROP TABLE x\n```</solution>"]
    assert solution_reward([None] * 3, garbage, task_id=["shop_1"] * 3, tasks=by_id) == [0.0] * 3
    # Two statements in one block is an error for the official evaluator, so for us too.
    two = (
        "<solution>```sql\nSELECT 1; SELECT name FROM customers WHERE city IS NULL\n```</solution>"
    )
    assert solution_reward([None], [two], task_id=["shop_1"], tasks=by_id) == [0.0]
    assert format_reward(prompts, completions) == [1.0] * 6
    assert format_reward(None, garbage) == [0.0] * 3
    assert get_reward("solution") is solution_reward
    with pytest.raises(ValueError, match="valid names: solution, format"):
        get_reward("accuracy")
    with pytest.raises(KeyError, match="register_tasks"):
        solution_reward([None], [completions[0]], task_id=["nowhere_1"])


@pytest.mark.stack
def test_smollm_ends_a_turn_with_the_eos_of_its_template() -> None:
    """SmolLM2's tokenizer converted from its GGUF: the EOS is the token the chat template closes
    an assistant turn with (id 2, generation_config's); transformers 5.17 (what a vLLM install
    resolves) read it as <|im_start|>, and a multi-turn rollout then refused the template."""
    from birdtrain.models import smollm_tokenizer

    tokenizer = smollm_tokenizer()
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "SELECT 1"}]
    assert "SELECT 1" + tokenizer.eos_token in tokenizer.apply_chat_template(turns, tokenize=False)

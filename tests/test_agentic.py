"""Stage 4: multi-turn rollouts over vector envs (exact token accounting) and agentic GRPO steps."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import birdenv  # noqa: F401 - registers BirdCritic-SQLite-v0
from birdenv.judge import judge
from birdenv.tools import TOOL_SCHEMAS, format_tool_call
from birdenv.vector import make_vec

pytest.importorskip("trl", reason="TRL is in the train extra")

from birdtrain import rollout
from birdtrain.config import load_config

DISABLED = rollout.VECTOR_KWARGS  # the one autoreset mode collect takes

FIX_1 = "SELECT name FROM customers WHERE city IS NULL"
WRONG_1 = "SELECT name FROM customers"
FIX_3 = "SELECT customer_id, SUM(total) FROM orders GROUP BY customer_id ORDER BY 2 DESC"

# Two plans per task: rollouts of a task alternate between them (a GRPO group with both outcomes).
SCRIPTS = {
    "shop_1": [
        [
            "Plan A: look first.\n" + format_tool_call("execute_sql", sql=FIX_1),
            "It works. " + format_tool_call("submit_solution", sql_list=[FIX_1]),
        ],
        [
            "Plan B: guess. I will not call a tool properly <tool_call>{oops</tool_call>",
            format_tool_call("submit_solution", sql_list=[WRONG_1]),
        ],
    ],
    "shop_3": [
        [format_tool_call("submit_solution", sql_list=[FIX_3])],
        ["Plan D\n" + format_tool_call("execute_sql", sql="SELECT ü FROM nowhere")],
    ],
}


class ScriptedPolicy:
    """A policy with the model wrapper's interface that plays fixed turns (tokens + logprobs)."""

    def __init__(self, tokenizer: Any, tasks: list, scripts: dict = SCRIPTS) -> None:
        self.tokenizer = tokenizer
        self.queries = {t.instance_id: t.query for t in tasks}
        self.scripts = scripts
        self.starts = 0

    def _turn(self, context: list[int]) -> str:
        text = self.tokenizer.decode(context, skip_special_tokens=False)
        task = next(t for t, q in self.queries.items() if q in text)
        plans = self.scripts[task]
        done = text.count("<|im_start|>assistant") - 1
        if done == 0:
            self.starts += 1
            plan = plans[(self.starts - 1) % len(plans)]
        else:
            plan = next(p for p in plans if p[0] in text)
        return plan[min(done, len(plan) - 1)]

    def generate(
        self, batch: list[list[int]], *, max_new_tokens: int, temperature: float
    ) -> list[tuple[list[int], list[float]]]:
        out = []
        for context in batch:
            ids = self.tokenizer(self._turn(context), add_special_tokens=False)["input_ids"]
            ids = ([*ids, self.tokenizer.eos_token_id])[:max_new_tokens]
            out.append((ids, [-0.25] * len(ids)))
        return out


class BrokenOnBoom(gym.Wrapper):
    """A BirdCriticEnv whose step fails (an env/worker error) when the turn says BOOM."""

    def step(self, action: str) -> Any:
        if "BOOM" in action:
            raise RuntimeError("the database worker died")
        return self.env.step(action)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from birdtrain.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(tiny: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


def _collect(envs: Any, policy: Any, task_ids: list[str], **kw: Any) -> rollout.Rollouts:
    options = {
        "num_generations": 2,
        "max_turns": 3,
        "max_new_tokens": 200,
        "temperature": 1.0,
        "max_context": 8192,
    }
    return rollout.collect(envs, policy, task_ids, **{**options, **kw})


def _check_accounting(traj: rollout.Episode, tokenizer: Any) -> None:
    """Mask-1 tokens are exactly the assistant turns; mask-0 tokens are the template's tool parts."""
    eos = tokenizer.eos_token
    assert len(traj.completion_ids) == len(traj.mask) == len(traj.logprobs)
    assistant = [m["content"] for m in traj.messages if m["role"] == "assistant"]
    tool = [m["content"] for m in traj.messages if m["role"] == "tool"]
    generated = [s for s in traj.segments if s.generated]
    template = [s for s in traj.segments if not s.generated]
    assert [tokenizer.decode(s.ids, skip_special_tokens=False) for s in generated] == [
        text + eos for text in assistant
    ]
    assert all(lp == -0.25 for s in generated for lp in s.logprobs)
    # One template block between two turns; it holds the tool observation and nothing of the model's.
    assert len(template) == len(generated) - 1
    for segment, observation in zip(template, tool, strict=False):
        text = tokenizer.decode(segment.ids, skip_special_tokens=False)
        assert text == (
            f"\n<|im_start|>user\n<tool_response>\n{observation}\n</tool_response>{eos}\n"
            "<|im_start|>assistant\n"
        )
        assert segment.logprobs == [0.0] * len(segment.ids)
    # The whole sequence is the chat template's rendering of the env's conversation, token for token.
    prompt = tokenizer.apply_chat_template(
        traj.messages[:1], tools=TOOL_SCHEMAS, tokenize=False, add_generation_prompt=True
    )
    assert traj.prompt_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    rendered = tokenizer.apply_chat_template(traj.messages, tools=TOOL_SCHEMAS, tokenize=False)
    decoded = tokenizer.decode(traj.prompt_ids + traj.completion_ids, skip_special_tokens=False)
    assert rendered.startswith(decoded) and decoded.endswith(eos)
    assert traj.turns == len(assistant)


@pytest.mark.stack
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_rollout_token_accounting_and_judge_rewards(
    asynchronous: bool, shop_tasks: list, tokenizer: Any
) -> None:
    by_id = {t.instance_id: t for t in shop_tasks}
    policy = ScriptedPolicy(tokenizer, shop_tasks)
    with contextlib.closing(
        make_vec(3, tasks=shop_tasks, asynchronous=asynchronous, vector_kwargs=DISABLED)
    ) as envs:
        first = _collect(envs, policy, ["shop_1", "shop_3"])
        # Reusing the env (slots whose episode just ended) still rolls out the requested tasks.
        again = _collect(envs, policy, ["shop_1"], num_generations=4)
    assert [(t.task_id, t.group) for t in first] == [
        ("shop_1", 0),
        ("shop_1", 1),
        ("shop_3", 0),
        ("shop_3", 1),
    ]
    for traj in [*first, *again]:
        assert not traj.dropped, traj.error
        _check_accounting(traj, tokenizer)
        calls = [m["content"] for m in traj.messages if m["role"] == "assistant"]
        if traj.verdict is not None:
            submitted = json.loads(calls[-1].split("<tool_call>")[1].split("</tool_call>")[0])
            verdict = judge(by_id[traj.task_id], submitted["arguments"]["sql_list"])
            assert traj.reward == float(verdict.passed)
            assert traj.verdict["status"] == verdict.status
    plans = {t.reward: t for t in first if t.task_id == "shop_1"}
    assert set(plans) == {0.0, 1.0}
    assert (plans[1.0].tool_calls, plans[1.0].invalid_calls, plans[1.0].turns) == (2, 0, 2)
    assert (plans[0.0].tool_calls, plans[0.0].invalid_calls, plans[0.0].turns) == (1, 1, 2)
    # shop_3 plan D never submits: an ordinary truncation after max_turns, reward 0, kept.
    wandering = next(t for t in first if t.task_id == "shop_3" and t.verdict is None)
    assert wandering.truncated and not wandering.dropped and wandering.turns == 3
    assert wandering.reward == 0.0 and wandering.messages[-1]["content"].startswith("status: error")
    assert sorted(t.reward for t in again) == [0.0, 0.0, 1.0, 1.0]
    assert first.env_steps >= 2 + 2 + 1 + 3 and first.env_s > 0 and first.generation_s > 0


class SecondEosPolicy(ScriptedPolicy):
    """Ends every turn with the model's other EOS id (``<|endoftext|>``), as Qwen's may."""

    def __init__(self, tokenizer: Any, tasks: list) -> None:
        super().__init__(tokenizer, tasks)
        self.other = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        self.eos_ids = frozenset({tokenizer.eos_token_id, self.other})

    def generate(self, batch: list[list[int]], **kw: Any) -> list[tuple[list[int], list[float]]]:
        return [([*ids[:-1], self.other], lps) for ids, lps in super().generate(batch, **kw)]


def test_any_eos_of_the_model_ends_a_turn(shop_tasks: list, tokenizer: Any) -> None:
    policy = SecondEosPolicy(tokenizer, shop_tasks)
    with contextlib.closing(
        make_vec(2, tasks=shop_tasks, asynchronous=False, vector_kwargs=DISABLED)
    ) as envs:
        trajs = _collect(envs, policy, ["shop_1"])
    passed = next(t for t in trajs if t.reward == 1.0)
    # The EOS is not part of the action the environment got, and the tool call parsed.
    assert (passed.tool_calls, passed.invalid_calls) == (2, 0)
    assert all("<|endoftext|>" not in m["content"] for m in passed.messages)
    # The template's own end-of-turn is not added after the model's.
    first_turn, tool_block = passed.segments[0], passed.segments[1]
    assert first_turn.generated and first_turn.ids[-1] == policy.other
    assert not tool_block.generated and tool_block.ids[0] != tokenizer.eos_token_id


def test_context_limit_truncates_without_dropping(shop_tasks: list, tokenizer: Any) -> None:
    policy = ScriptedPolicy(tokenizer, shop_tasks)
    with contextlib.closing(
        make_vec(2, tasks=shop_tasks, asynchronous=False, vector_kwargs=DISABLED)
    ) as envs:
        prompt_len = len(_collect(envs, policy, ["shop_1"], num_generations=1)[0].prompt_ids)
        [traj] = _collect(envs, policy, ["shop_1"], num_generations=1, max_context=prompt_len + 40)
    assert traj.truncated and not traj.dropped and traj.verdict is None and traj.reward == 0.0
    assert traj.context_length <= prompt_len + 40 and traj.turns == 1


def test_broken_env_is_dropped(shop_tasks: list, tokenizer: Any) -> None:
    boom = {"shop_1": [["BOOM " + format_tool_call("execute_sql", sql="SELECT 1")]]}
    fns = [
        lambda: BrokenOnBoom(gym.make("BirdCritic-SQLite-v0", tasks=shop_tasks)) for _ in range(2)
    ]
    with contextlib.closing(gym.vector.SyncVectorEnv(fns, **DISABLED)) as envs:
        broken = _collect(envs, ScriptedPolicy(tokenizer, shop_tasks, boom), ["shop_1"])
        assert [t.dropped for t in broken] == [True, True]
        assert "the database worker died" in broken[0].error
        # The same vector env keeps working for the next rollouts.
        fine = _collect(envs, ScriptedPolicy(tokenizer, shop_tasks), ["shop_1"])
    assert [t.dropped for t in fine] == [False, False]
    assert sorted(t.reward for t in fine) == [0.0, 1.0]


def test_user_built_vector_env(shop_tasks: list, tokenizer: Any) -> None:
    """A SyncVectorEnv the user builds from gym.make works in the autoreset mode collect takes;
    the other modes are refused with the way to build one."""
    fns = [lambda: gym.make("BirdCritic-SQLite-v0", tasks=shop_tasks) for _ in range(3)]
    with contextlib.closing(gym.vector.SyncVectorEnv(fns, **DISABLED)) as envs:
        trajs = _collect(envs, ScriptedPolicy(tokenizer, shop_tasks), ["shop_1", "shop_3"])
        trajs += _collect(envs, ScriptedPolicy(tokenizer, shop_tasks), ["shop_1"])
    assert not any(t.dropped for t in trajs)
    for traj in trajs:
        _check_accounting(traj, tokenizer)
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    for mode in (gym.vector.AutoresetMode.NEXT_STEP, gym.vector.AutoresetMode.SAME_STEP):
        envs = gym.vector.SyncVectorEnv(fns[:1], autoreset_mode=mode)
        with contextlib.closing(envs), pytest.raises(ValueError, match=r"DISABLED.*VECTOR_KWARGS"):
            _collect(envs, ScriptedPolicy(tokenizer, shop_tasks), ["shop_1"])


@pytest.mark.parametrize(
    ("mode", "recorded"),
    [(gym.vector.AutoresetMode.NEXT_STEP, False), (gym.vector.AutoresetMode.DISABLED, True)],
    ids=["next-step", "disabled"],
)
def test_an_explicit_reset_leaves_no_pending_autoreset(
    mode: Any, recorded: bool, shop_tasks: list
) -> None:
    """Why collect takes one autoreset mode. In Gymnasium 1.4 an ``AsyncVectorEnv`` worker (text
    spaces need ``shared_memory=False``) keeps the autoreset pending from an episode's end across
    an explicit ``reset``, so with ``NEXT_STEP`` the first turn after it is swallowed by a second
    reset. With autoreset disabled nothing is pending, so every turn lands: collect needs no retry.
    """
    submit = format_tool_call("submit_solution", sql_list=[FIX_1])
    explore = format_tool_call("execute_sql", sql="SELECT 1")
    with contextlib.closing(
        make_vec(1, tasks=shop_tasks, asynchronous=True, vector_kwargs={"autoreset_mode": mode})
    ) as envs:
        envs.reset(options={"task_id": "shop_1"})
        _, _, terminated, _, _ = envs.step((submit,))
        assert terminated[0]
        envs.reset(options={"task_id": "shop_3", "reset_mask": np.array([True])})
        _, _, _, _, infos = envs.step((explore,))
    messages = infos["messages"][0]
    assert infos["task_id"][0] == "shop_3" or not recorded
    assert (messages[-2:-1] == [{"role": "assistant", "content": explore}]) == recorded


def _stage4_config(**stage4: Any) -> Any:
    cfg = load_config("smoke")
    cfg.data.max_train_tasks = None
    for key, value in {
        "max_steps": 2,
        "num_generations": 2,
        "tasks_per_step": 2,
        "max_turns": 2,
        "max_new_tokens": 24,
        **stage4,
    }.items():
        setattr(cfg.stage4, key, value)
    return cfg


def _read_metrics(path: Path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in lines if "agentic/reward_mean" in r]


def test_two_grpo_steps_sync_scripted_actor(shop_tasks: list, tiny: Path, tmp_path: Path) -> None:
    """GRPO through a SyncVectorEnv; a scripted actor gives each group a pass and a fail."""
    from birdtrain.stages import agentic

    tasks = [t for t in shop_tasks if t.instance_id in ("shop_1", "shop_3")]
    cfg = _stage4_config(vector="sync", max_new_tokens=200)
    with contextlib.closing(
        make_vec(2, tasks=tasks, asynchronous=False, vector_kwargs=DISABLED)
    ) as envs:
        checkpoint = agentic.run(
            cfg,
            model_path=str(tiny),
            out_dir=tmp_path / "stage4",
            tasks=tasks,
            envs=envs,
            policy=lambda trainer: ScriptedPolicy(trainer.processing_class, tasks),
        )
    assert (checkpoint / "config.json").is_file() and (checkpoint / "tokenizer.json").is_file()
    steps = _read_metrics(tmp_path / "stage4" / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["agentic/reward_mean"] == 0.5 and record["agentic/pass_rate"] == 0.5
        assert record["agentic/reward_std"] == 0.5
        assert record["agentic/tool_calls_per_traj"] > 0
        assert 0 < record["agentic/invalid_call_rate"] < 1
        assert record["agentic/env_steps"] >= 4 and record["agentic/dropped"] == 0
        assert record["agentic/env_s"] > 0 and "loss" in record and "learning_rate" in record
        # Mixed outcomes in every group: GRPO has a signal.
        assert record["frac_reward_zero_std"] == 0.0


@pytest.mark.stack
def test_micro_batches_train_the_step_generated_once(
    shop_tasks: list, tiny: Path, tmp_path: Path
) -> None:
    """Micro-batches of one sequence: TRL still hands rollout_func the whole step (2 tasks x 2
    rollouts) once per optimizer step, so every group's baseline holds its own rollouts."""
    from birdtrain.stages import agentic

    tasks = [t for t in shop_tasks if t.instance_id in ("shop_1", "shop_3")]
    cfg = _stage4_config(vector="sync", max_new_tokens=200, micro_batch_size=1)
    steps_seen: list[int] = []

    def scripted(trainer: Any) -> ScriptedPolicy:
        steps_seen.append(trainer.state.global_step)
        args = trainer.args
        assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, 4)
        return ScriptedPolicy(trainer.processing_class, tasks)

    with contextlib.closing(
        make_vec(2, tasks=tasks, asynchronous=False, vector_kwargs=DISABLED)
    ) as envs:
        agentic.run(
            cfg,
            model_path=str(tiny),
            out_dir=tmp_path / "s4",
            tasks=tasks,
            envs=envs,
            policy=scripted,
        )
    assert steps_seen == [0, 1]  # one rollout per optimizer step, not one per micro-batch
    steps = _read_metrics(tmp_path / "s4" / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        # Every group holds the scripted pass and fail: the groups stayed whole.
        assert record["agentic/reward_mean"] == 0.5 and record["frac_reward_zero_std"] == 0.0


def test_a_resumed_stage4_stores_each_step_once(
    shop_tasks: list, tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stage 4 stopped after a step's rollouts were stored but before its checkpoint: the resumed
    run takes that step again, and the trajectory store keeps the rollouts of the run that went on,
    one batch per step, as ``groups.jsonl`` does."""
    from transformers import TrainerCallback

    from birdtrain.stages import agentic
    from birdtrain.stages.training import train
    from birdtrain.trajectory_store import TrajectoryStore

    tasks = [t for t in shop_tasks if t.instance_id in ("shop_1", "shop_3")]
    cfg = _stage4_config(vector="sync", max_new_tokens=200, max_steps=3, save_steps=1)
    out = tmp_path / "s4"

    class Killed(Exception):
        pass

    class KillBeforeSecondSave(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:  # step 2 trained and its rollouts stored, not yet saved
                raise Killed

    def scripted(trainer: Any) -> ScriptedPolicy:
        return ScriptedPolicy(trainer.processing_class, tasks)

    with contextlib.closing(
        make_vec(2, tasks=tasks, asynchronous=False, vector_kwargs=DISABLED)
    ) as envs:
        interrupted = agentic.build_trainer(
            cfg, model_path=str(tiny), out_dir=out, tasks=tasks, envs=envs, policy=scripted
        )
        interrupted.add_callback(KillBeforeSecondSave())
        with pytest.raises(Killed):
            train(interrupted)
        store = TrajectoryStore(out)
        per_step = "SELECT step, count(DISTINCT episode) FROM trajectories GROUP BY 1 ORDER BY 1"
        assert store.query(per_step) == [(0, 4), (1, 4)]
        # As a second round of dynamic sampling in step 2 would have stored it: undone as well.
        first = store.dir / "part-stage4-step000001-000.parquet"
        shutil.copy(first, first.with_name("part-stage4-step000001-001.parquet"))
        assert len(store.parts("stage4-step000001")) == 2
        capsys.readouterr()
        agentic.run(cfg, model_path=str(tiny), out_dir=out, tasks=tasks, envs=envs, policy=scripted)
    assert "resuming from" in capsys.readouterr().out
    assert store.query(per_step) == [(0, 4), (1, 4), (2, 4)]
    assert [p.name for p in store.files()] == [
        f"part-stage4-step{step:06d}-000.parquet" for step in range(3)
    ]


@pytest.mark.stack
def test_two_grpo_steps_async_tiny_model(shop_tasks: list, tiny: Path, tmp_path: Path) -> None:
    """GRPO with the tiny model generating, through the default async vector env."""
    from birdtrain.stages import agentic

    # No dynamic sampling: every step rolls out exactly its own task (2 rollouts x 2 turns).
    cfg = _stage4_config(
        vector="async", num_envs=2, tasks_per_step=1, max_new_tokens=8, dynamic_sampling_rounds=0
    )
    checkpoint = agentic.run(cfg, model_path=str(tiny), out_dir=tmp_path / "s4", tasks=shop_tasks)
    assert (checkpoint / "model.safetensors").is_file()
    steps = _read_metrics(tmp_path / "s4" / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        # A random model never writes a tool call: every turn is an invalid call, judged 0.
        assert record["agentic/env_steps"] == 2 * 2 and record["agentic/turns"] == 2
        assert record["agentic/invalid_call_rate"] == 1.0 and record["agentic/reward_mean"] == 0.0
        assert record["agentic/generation_s"] > 0 and record["agentic/dropped"] == 0


def test_dropped_rollouts_get_no_reward_and_no_loss(shop_tasks: list, tokenizer: Any) -> None:
    from birdtrain.stages.agentic import make_reward_func, make_rollout_func

    boom = {"shop_1": [["BOOM"]]}
    fns = [
        lambda: BrokenOnBoom(gym.make("BirdCritic-SQLite-v0", tasks=shop_tasks)) for _ in range(2)
    ]
    cfg = _stage4_config()

    class Trainer:
        processing_class = tokenizer

    with contextlib.closing(gym.vector.SyncVectorEnv(fns, **DISABLED)) as envs:
        func = make_rollout_func(
            envs, cfg.stage4, lambda trainer: ScriptedPolicy(tokenizer, shop_tasks, boom)
        )
        prompt = [{"role": "user", "content": "shop_1"}]
        out = func([prompt, prompt], Trainer())
    assert out["env_mask"] == [[0] * len(ids) for ids in out["completion_ids"]]
    assert out["agent_dropped"] == [True, True] and out["agent_reward"] == [None, None]
    logged: dict[str, float] = {}
    rewards = make_reward_func()(
        [prompt] * 2,
        [[]] * 2,
        log_metric=logged.__setitem__,
        **{k: v for k, v in out.items() if k.startswith(("agent_", "sampling_"))},
    )
    assert rewards == [None, None] and logged["agentic/dropped"] == 2.0


def _scripted_step(
    tokenizer: Any,
    tasks: list,
    stage: Any,
    scripts: dict,
    task_id: str,
    pool: list[str] | None = None,
) -> dict[str, Any]:
    """The stage-4 rollout step of two rollouts of ``task_id`` in ``tasks``, played by scripts."""
    from birdtrain.stages.agentic import make_rollout_func

    class Trainer:
        processing_class = tokenizer

    with contextlib.closing(
        make_vec(2, tasks=tasks, asynchronous=False, vector_kwargs=DISABLED)
    ) as envs:
        func = make_rollout_func(
            envs, stage, lambda trainer: ScriptedPolicy(tokenizer, tasks, scripts), pool=pool
        )
        prompt = [{"role": "user", "content": task_id}]
        return func([prompt, prompt], Trainer())


@pytest.mark.parametrize("rounds", [0, 2])
def test_dynamic_sampling_replaces_groups_without_variance(
    rounds: int, shop_tasks: list, tokenizer: Any
) -> None:
    """A group whose rollouts all fail is replaced by another task's informative group."""
    from birdtrain.stages.agentic import make_reward_func

    scripts = {**SCRIPTS, "shop_3": [[format_tool_call("submit_solution", sql_list=[WRONG_1])]]}
    tasks = [t for t in shop_tasks if t.instance_id in ("shop_1", "shop_3")]
    cfg = _stage4_config(dynamic_sampling_rounds=rounds, max_new_tokens=200)
    prompt = [{"role": "user", "content": "shop_3"}]
    out = _scripted_step(tokenizer, tasks, cfg.stage4, scripts, "shop_3", pool=["shop_1", "shop_3"])
    logged: dict[str, float] = {}
    rewards = make_reward_func()(
        [prompt] * 2,
        [[]] * 2,
        log_metric=logged.__setitem__,
        **{k: v for k, v in out.items() if k.startswith(("agent_", "sampling_"))},
    )
    assert logged["sampling/frac_reward_zero_std_before"] == 1.0
    # The step's own draw (shop_3, all failed) is what the policy earned, whatever was trained on.
    assert logged["sampling/reward_before"] == 0.0 and logged["sampling/groups"] == 1.0
    if rounds:
        # shop_1's group (a pass and a fail) took the slot; 4 rollouts were spent for it.
        assert sorted(rewards) == [0.0, 1.0]
        assert logged["sampling/frac_reward_zero_std_after"] == 0.0
        assert logged["sampling/resampled_groups"] == 1.0 and logged["sampling/rollouts"] == 4.0
    else:
        assert rewards == [0.0, 0.0] and logged["sampling/frac_reward_zero_std_after"] == 1.0
        assert logged["sampling/resampled_groups"] == 0.0 and logged["sampling/rollouts"] == 2.0


class Submits:
    """A policy that submits one fixed list of statements on its first turn."""

    def __init__(self, tokenizer: Any, sql_list: list[str]) -> None:
        self.tokenizer = tokenizer
        self.turn = format_tool_call("submit_solution", sql_list=sql_list)

    def generate(self, batch: list, *, max_new_tokens: int, temperature: float) -> list:
        ids = [*self.tokenizer(self.turn, add_special_tokens=False)["input_ids"]]
        return [([*ids, self.tokenizer.eos_token_id], [-0.5] * (len(ids) + 1)) for _ in batch]


def test_fraction_reward_scores_bird_questions(tokenizer: Any) -> None:
    """``reward: fraction`` gives a right BIRD answer the environment's reward (1), not 0."""
    from birdenv.tasks import load_tasks
    from birdtrain.stages.agentic import make_rollout_func

    question = load_tasks("bird-mini-eval")[0]
    cfg = _stage4_config(reward="fraction", max_new_tokens=400, dynamic_sampling_rounds=0)

    class Trainer:
        processing_class = tokenizer

    with contextlib.closing(
        make_vec(2, tasks=[question], reward="fraction", vector_kwargs=DISABLED)
    ) as envs:
        func = make_rollout_func(
            envs, cfg.stage4, lambda trainer: Submits(tokenizer, [question.SQL])
        )
        prompt = [{"role": "user", "content": question.instance_id}]
        out = func([prompt, prompt], Trainer())
    assert out["agent_passed"] == [True, True] and out["agent_reward"] == [1.0, 1.0]


@pytest.mark.parametrize(("weight", "rewards"), [(0.0, [1.0, 0.0]), (0.2, [1.2, 0.1])])
def test_stage4_format_reward_adds_the_share_of_parsed_calls(
    weight: float, rewards: list[float], shop_tasks: list, tokenizer: Any
) -> None:
    """Plan A (two parsed calls, a pass) and plan B (a broken call, then a wrong submission):
    the verdict alone by default, plus the weight times 2/2 and 1/2 of parsed turns."""
    tasks = [t for t in shop_tasks if t.instance_id == "shop_1"]
    cfg = _stage4_config(format_reward_weight=weight, max_new_tokens=200)
    cfg.stage4.dynamic_sampling_rounds = 0
    out = _scripted_step(tokenizer, tasks, cfg.stage4, SCRIPTS, "shop_1")
    assert out["agent_passed"] == [True, False] and out["agent_invalid_calls"] == [0, 1]
    assert out["agent_reward"] == pytest.approx(rewards)


def test_stage4_format_reward_weight_is_not_negative() -> None:
    with pytest.raises(ValueError, match=r"stage4.format_reward_weight must be >= 0"):
        load_config("smoke", overrides=["stage4.format_reward_weight=-0.1"])


def test_stage4_refuses_fewer_tasks_than_one_step(shop_tasks: list, tiny: Path, tmp_path: Path):
    """TRL drops an incomplete batch: 1 task with tasks_per_step=2 would train zero steps."""
    from birdtrain.stages import agentic
    from birdtrain.stages.training import StageError

    cfg = _stage4_config(vector="sync", tasks_per_step=2)
    with pytest.raises(StageError, match=r"stage4.tasks_per_step=2"):
        agentic.run(cfg, model_path=str(tiny), out_dir=tmp_path / "s4", tasks=shop_tasks[:1])
    assert not (tmp_path / "s4" / "checkpoint").exists()


@pytest.mark.stack
def test_generation_policy_picks_an_engine_that_exists(tiny: Path) -> None:
    import importlib.util

    import torch

    from birdtrain.policies import TransformersPolicy, generation_policy

    if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
        policy = generation_policy(str(tiny), engine="auto")
        assert isinstance(policy, TransformersPolicy)
        ids = policy.tokenizer("SELECT 1")["input_ids"]
        ((out, logps),) = policy.generate([ids], max_new_tokens=3, temperature=0.0)
        assert 0 < len(out) <= 3 and len(logps) == len(out)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match=r"bird-rl\[vllm\]"):
            generation_policy(str(tiny), engine="vllm")
    with pytest.raises(ValueError, match="engine must be"):
        generation_policy(str(tiny), engine="tpu")

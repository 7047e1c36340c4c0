"""One behavioural contract, run against the Gymnasium environment and every framework adapter.

Each adapter is driven through its framework's own machinery, nothing of the framework mocked:
verl's ``ToolAgentLoop`` (instantiated from verl's registry, tools loaded from the shipped YAML by
verl's loader) with a scripted policy in place of the language-model server; a real
``birdenv serve`` process on 127.0.0.1 with OpenEnv's own client; ``skyrl_gym.make`` with steps in
a thread pool, as SkyRL's generator runs them. The contract: state persists across turns; two
concurrent trajectories never see each other's writes; the oracle submission gets reward 1 and
the echo submission 0; a bad tool call is an error observation; an abandoned trajectory frees its
session (the replica pool's open sessions return to where they were).

The frameworks live in the ``.venv-adapters`` lane of ``make test`` (verl pins transformers below
the training stack's). Elsewhere their cases skip and say so; in that lane
(``BIRDENV_ADAPTERS_LANE=1``) a missing framework fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import importlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest

import birdenv
from birdenv.agents import EchoAgent, OracleAgent
from birdenv.replicas.pool import default_pool
from birdenv.tools import format_tool_call

ROOT = Path(__file__).resolve().parents[1]
SUITE = "gym-mini"  # the suite examples/verl/tool_config.yaml names
TASK_ID = "bank_finance_002"
MAX_TURNS = 10
WRITE = format_tool_call(
    "execute_sql", sql="CREATE TABLE probe AS SELECT 41 + 1 AS answer"
)  # a real table in the trajectory's own database, not a TEMP one
READ = format_tool_call("execute_sql", sql="SELECT answer FROM probe")
BAD_CALLS = [
    format_tool_call("execute_sql", query="SELECT 1"),  # the argument is `sql`
    format_tool_call("execute_sql", sql="SELEC 1"),  # SQLite rejects it
]


def framework(module: str) -> Any:
    """Import a framework; in the adapters lane its absence is a failure, elsewhere a skip."""
    if os.environ.get("BIRDENV_ADAPTERS_LANE"):
        return importlib.import_module(module)
    return pytest.importorskip(module, reason="in the .venv-adapters lane of make test")


def task() -> Any:
    return next(t for t in birdenv.load_tasks(SUITE) if t.instance_id == TASK_ID)


#: How long a wait that ends as soon as its event happens may last before it is called a hang.
#: Generous: a loaded machine is slow, and only an event that never comes should fail a test.
HANG = 300


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


# -- drivers: one trajectory of each framework, stepped by the test ------------------------------
class Run:
    """One trajectory under test: ``step(text) -> (observation, reward, done)``, ``abandon()``."""

    def step(self, text: str) -> tuple[str, float, bool]:
        raise NotImplementedError

    def abandon(self) -> None:
        raise NotImplementedError


class GymRun(Run):
    def __init__(self) -> None:
        self.env = gym.make("BirdCritic-SQLite-v0", suite=SUITE, max_episode_steps=MAX_TURNS)
        self.env.reset(options={"task_id": TASK_ID})

    def step(self, text: str) -> tuple[str, float, bool]:
        observation, reward, terminated, truncated, _ = self.env.step(text)
        return observation, float(reward), terminated or truncated

    def abandon(self) -> None:
        self.env.close()


class SkyRLRun(Run):
    """Made by ``skyrl_gym.make`` and stepped in a thread pool, as SkyRL's generator does."""

    pool = concurrent.futures.ThreadPoolExecutor(4)

    def __init__(self) -> None:
        skyrl_gym = framework("skyrl_gym")
        import birdenv.integrations.skyrl  # noqa: F401  (registers the environments)

        self.env = skyrl_gym.make(
            "BirdCritic-SQLite-v0",
            env_config={"suite": SUITE},
            extras={"task_id": TASK_ID, "max_turns": MAX_TURNS},
        )
        conversation, _ = self.pool.submit(
            self.env.init, [{"role": "user", "content": ""}]
        ).result()
        assert "# Database Schema:" in conversation[-1]["content"]

    def step(self, text: str) -> tuple[str, float, bool]:
        output = self.pool.submit(self.env.step, text).result()
        observations = output["observations"]
        text = observations[0]["content"] if observations else output["metadata"]["observation"]
        return text, float(output["reward"]), output["done"]

    def abandon(self) -> None:
        self.pool.submit(self.env.close).result()


# verl: a scripted policy in place of the language-model server ------------------------------------
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer (one token per byte: decoding is exact) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + 256,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["x"], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = _CHAT_TEMPLATE
    return fast


class ScriptedServer:
    """verl's LLM-server client, answered by the test: each ``generate`` hands the prompt it got to
    the test and returns the next turn the test gives."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.prompts: asyncio.Queue[str] = asyncio.Queue()
        self.turns: asyncio.Queue[str | BaseException] = asyncio.Queue()

    async def generate(self, *, prompt_ids: list[int], **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        await self.prompts.put(self.tokenizer.decode(prompt_ids))
        turn = await self.turns.get()
        if isinstance(turn, BaseException):
            raise turn
        return TokenOutput(token_ids=self.tokenizer.encode(turn, add_special_tokens=False))


class VerlHarness:
    """An event loop in a thread, verl's tools from the shipped YAML, and agent loops made from
    verl's registry the way its ``AgentLoopWorker`` makes them."""

    def __init__(self) -> None:
        framework("verl")
        from omegaconf import OmegaConf
        from verl.tools.tool_registry import initialize_tools_from_config

        import birdenv.integrations.verl as adapter

        self.adapter = adapter
        self.tokenizer = byte_tokenizer()
        self.tools = initialize_tools_from_config(str(ROOT / "examples/verl/tool_config.yaml"))
        self.config = OmegaConf.create(
            {
                "actor_rollout_ref": {
                    "rollout": {
                        "prompt_length": 1 << 20,
                        "response_length": 1 << 20,
                        "full_determinism": False,
                        "multi_turn": {
                            "max_user_turns": 20,
                            "max_assistant_turns": 20,
                            "max_parallel_calls": 1,
                            "max_tool_response_length": 8192,
                            "tool_response_truncate_side": "middle",
                            "format": "hermes",
                        },
                    }
                },
                "data": {"apply_chat_template_kwargs": {}},
            }
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        (self.row,) = adapter.verl_rows(tasks=[task()])

    def call(self, coroutine: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def make_loop(self, server: ScriptedServer) -> Any:
        import hydra
        from verl.experimental.agent_loop.agent_loop import (
            DictConfigWrap,
            ToolListWrap,
            _agent_loop_registry,
        )
        from verl.utils.dataset.rl_dataset import RLHFDataset

        return hydra.utils.instantiate(
            config=_agent_loop_registry[self.row["agent_name"]],
            trainer_config=DictConfigWrap(config=self.config),
            server_manager=server,
            tokenizer=self.tokenizer,
            processor=None,
            hf_model_type=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(self.config.data),
            tools=ToolListWrap(self.tools),
        )

    def close(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.call(cancel_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class VerlRun(Run):
    """One rollout of the registered agent loop; ``step`` answers its next ``generate``."""

    def __init__(self, harness: VerlHarness) -> None:
        self.harness = harness
        self.server = harness.call(self._server())
        agent_loop = harness.call(harness.make_loop(self.server))
        row = harness.row
        kwargs = {
            "raw_prompt": list(row["prompt"]),
            "tools_kwargs": row["extra_info"]["tools_kwargs"],
            "extra_info": row["extra_info"],
        }
        self.rollout: asyncio.Task = harness.call(
            self._start(agent_loop.run({"temperature": 1.0}, **kwargs))
        )
        prompt = harness.call(self.server.prompts.get())
        assert "# Database Schema:" in prompt
        self.output: Any = None

    async def _server(self) -> ScriptedServer:
        return ScriptedServer(self.harness.tokenizer)

    @staticmethod
    async def _start(coroutine: Any) -> asyncio.Task:
        return asyncio.ensure_future(coroutine)

    async def _result(self) -> Any:
        return await self.rollout

    async def _cancel(self) -> None:
        self.rollout.cancel()  # cancellation reaches verl's loop mid-generate
        with contextlib.suppress(asyncio.CancelledError):
            await self.rollout  # its finally has run once this returns

    async def _next(self) -> str | None:
        """The next prompt verl asks the policy about, or None when the rollout has ended."""
        prompt = asyncio.ensure_future(self.server.prompts.get())
        done, _ = await asyncio.wait({self.rollout, prompt}, return_when=asyncio.FIRST_COMPLETED)
        if prompt in done:
            return prompt.result()
        prompt.cancel()
        return None

    def step(self, text: str) -> tuple[str, float, bool]:
        self.harness.call(self.server.turns.put(text))
        prompt = self.harness.call(self._next())
        if prompt is None:  # a submission ends the rollout: the reward is the verdict's
            self.output = self.harness.call(self._result())
            return "", float(self.output.reward_score), True
        # The tool's response, as the model sees it in its next prompt.
        return prompt.rpartition("<|im_start|>tool\n")[2].partition("<|im_end|>")[0], 0.0, False

    def abandon(self) -> None:
        self.harness.call(self._cancel())


# OpenEnv: a real `birdenv serve` and OpenEnv's client ------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """``birdenv serve`` in its own process, on 127.0.0.1."""

    def __init__(self, *options: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = Path(sys.executable).with_name("birdenv")
        self.process = subprocess.Popen(
            [str(command), "serve", "--port", str(self.port), "--suite", SUITE, *options],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.banner = self.process.stdout.readline()
        # Drain what the server prints: a full pipe would block its logging, and its event loop.
        self.output: list[str] = []
        threading.Thread(
            target=self.output.extend, args=(self.process.stdout,), daemon=True
        ).start()
        import requests

        def up() -> bool:
            assert self.process.poll() is None, "".join(self.output)
            with contextlib.suppress(requests.ConnectionError):
                return requests.get(f"{self.url}/health", timeout=5).ok
            return False

        # The first start on a machine builds the suite's databases (70 s under load was seen).
        wait_for(up, 2 * HANG, "birdenv serve answers /health")

    def pool(self) -> dict[str, int]:
        """The server's replica pool: ``open_sessions`` (leases) and ``peak_sessions``."""
        import requests

        return requests.get(f"{self.url}/birdenv/pool", timeout=60).json()

    def leases(self) -> int:
        return self.pool()["open_sessions"]

    def close(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class OpenEnvRun(Run):
    def __init__(self, server: Server) -> None:
        framework("openenv")
        from birdenv.integrations.openenv import BirdAction, BirdEnvClient

        self.action = BirdAction
        self.client = BirdEnvClient(base_url=server.url).sync()
        self.client.connect()
        result = self.client.reset(task_id=TASK_ID)
        assert "# Database Schema:" in result.observation.text
        assert result.observation.task_id == TASK_ID

    def step(self, text: str) -> tuple[str, float, bool]:
        result = self.client.step(self.action(text=text))
        return result.observation.text, float(result.reward or 0.0), result.done

    def abandon(self) -> None:
        self.client.close()


# -- the contract ------------------------------------------------------------------------------
class Adapter:
    """How to start a trajectory of one framework, and how many leases its pool holds."""

    def __init__(self, name: str, open_run: Callable[[], Run], leases: Callable[[], int]) -> None:
        self.name, self.open, self.leases = name, open_run, leases


def local_leases() -> int:
    return default_pool().stats()["open_sessions"]


@pytest.fixture(scope="module")
def verl_harness() -> Iterator[VerlHarness]:
    harness = VerlHarness()
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def openenv_server() -> Iterator[Server]:
    """The contract's server, with the default idle timeout: a turn that comes seconds after the
    last one (a loaded machine) finds its session."""
    framework("openenv")
    server = Server("--max-turns", str(MAX_TURNS))
    yield server
    server.close()


@pytest.fixture
def reaping_server() -> Iterator[Server]:
    """A server that closes a session after 1 s of silence."""
    framework("openenv")
    server = Server("--max-turns", str(MAX_TURNS), "--idle-timeout", "1")
    yield server
    server.close()


@pytest.fixture(params=["gymnasium", "verl", "openenv", "skyrl"])
def adapter(request: pytest.FixtureRequest) -> Adapter:
    if request.param == "gymnasium":
        return Adapter("gymnasium", GymRun, local_leases)
    if request.param == "skyrl":
        framework("skyrl_gym")
        return Adapter("skyrl", SkyRLRun, local_leases)
    if request.param == "verl":
        harness = request.getfixturevalue("verl_harness")
        return Adapter("verl", lambda: VerlRun(harness), local_leases)
    server = request.getfixturevalue("openenv_server")
    return Adapter("openenv", lambda: OpenEnvRun(server), server.leases)


def test_state_persists_across_turns(adapter: Adapter) -> None:
    run = adapter.open()
    try:
        assert run.step(WRITE)[0].startswith("status: ok")
        observation, reward, done = run.step(READ)
        assert observation.startswith("status: ok") and observation.rstrip().endswith("| 42 |")
        assert (reward, done) == (0.0, False)
    finally:
        run.abandon()


def test_concurrent_trajectories_never_see_each_others_writes(adapter: Adapter) -> None:
    first, second = adapter.open(), adapter.open()
    try:
        assert first.step(WRITE)[0].startswith("status: ok")
        observation = second.step(READ)[0]
        assert observation.startswith("status: error") and "no such table: probe" in observation
        assert second.step(WRITE)[0].startswith("status: ok")  # its own table, of the same name
        assert first.step(READ)[0].rstrip().endswith("| 42 |")
    finally:
        first.abandon()
        second.abandon()


@pytest.mark.parametrize("agent, expected", [(OracleAgent(), 1.0), (EchoAgent(), 0.0)])
def test_the_oracle_scores_1_and_the_echo_0(adapter: Adapter, agent: Any, expected: float) -> None:
    run = adapter.open()
    try:
        turns = agent.turns(task())
        for number, turn in enumerate(turns, 1):
            _, reward, done = run.step(turn)
            assert done == (number == len(turns)), f"turn {number}: {turn}"
        assert reward == expected
    finally:
        run.abandon()


def test_a_bad_tool_call_is_an_error_observation(adapter: Adapter) -> None:
    run = adapter.open()
    try:
        for call in BAD_CALLS:
            observation, reward, done = run.step(call)
            assert observation.startswith("status: error"), observation
            assert (reward, done) == (0.0, False)
        assert run.step(READ)[0].startswith("status: error")  # no table yet: still playing
        assert run.step(WRITE)[0].startswith("status: ok")
    finally:
        run.abandon()


def test_an_abandoned_trajectory_frees_its_session(adapter: Adapter) -> None:
    before = adapter.leases()
    run = adapter.open()
    assert run.step(WRITE)[0].startswith("status: ok")
    assert adapter.leases() == before + 1
    run.abandon()
    wait_for(lambda: adapter.leases() == before, HANG, f"{adapter.name}: the session is freed")


# -- what only one framework has ---------------------------------------------------------------
def test_verl_frees_the_session_when_the_policy_fails(verl_harness: VerlHarness) -> None:
    before = local_leases()
    run = VerlRun(verl_harness)
    assert run.step(WRITE)[0].startswith("status: ok")
    assert local_leases() == before + 1
    verl_harness.call(run.server.turns.put(RuntimeError("the server went away")))
    with pytest.raises(RuntimeError, match="the server went away"):
        verl_harness.call(run._result())
    assert local_leases() == before
    assert verl_harness.adapter.open_trajectories() == 0


def test_verl_rollout_reward_and_verdict_come_from_the_judge(verl_harness: VerlHarness) -> None:
    run = VerlRun(verl_harness)
    for turn in OracleAgent().turns(task()):
        _, reward, done = run.step(turn)
    assert done and reward == 1.0
    assert run.output.extra_fields["verdict"]["status"] == "success"
    assert sum(run.output.response_mask) > 0  # the model's own tokens are trained on


def test_openenv_step_without_a_session_is_a_clear_409(openenv_server: Server) -> None:
    import requests

    response = requests.post(
        f"{openenv_server.url}/step", json={"action": {"text": READ}}, timeout=30
    )
    assert response.status_code == 409, response.text
    assert "/ws" in response.json()["detail"]
    schema = requests.get(f"{openenv_server.url}/schema", timeout=30).json()
    assert set(schema["action"]["properties"]) >= {"text"}
    assert set(schema["observation"]["properties"]) >= {"text", "verdict", "task_id"}


def test_openenv_binds_loopback_and_an_idle_session_loses_its_lease(
    reaping_server: Server,
) -> None:
    assert f"http://127.0.0.1:{reaping_server.port}" in reaping_server.banner
    run = OpenEnvRun(reaping_server)  # its reset leases the episode's session
    # The lease was taken: the pool's peak says so whether or not the reaper has come since (on
    # a loaded machine a second passes between any two calls, and a check of the open leases
    # would race it).
    assert reaping_server.pool()["peak_sessions"] == 1
    # Connected but silent: OpenEnv's reaper (every 5 s at the least) closes it after 1 s idle.
    wait_for(
        lambda: reaping_server.leases() == 0,
        HANG,
        "the idle session is reaped (the reaper looks every 5 s: only one that never comes "
        "takes this long)",
    )
    # Its next turn says why the episode is gone, not that it was played out.
    observation, reward, done = run.step(READ)
    assert observation.startswith("status: error") and "idle past its timeout" in observation
    assert (reward, done) == (0.0, True)
    run.abandon()


def test_openenv_a_client_killed_mid_episode_frees_its_session(openenv_server: Server) -> None:
    before = openenv_server.leases()
    client = textwrap.dedent(
        f"""
        import time
        from birdenv.integrations.openenv import BirdAction, BirdEnvClient
        env = BirdEnvClient(base_url={openenv_server.url!r}).sync()
        env.connect()
        env.reset(task_id={TASK_ID!r})
        env.step(BirdAction(text={WRITE!r}))
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", client], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        assert openenv_server.leases() == before + 1
    finally:
        process.kill()
        process.wait()
    wait_for(
        lambda: openenv_server.leases() == before, HANG, "the killed client's session is freed"
    )


def test_openenv_trl_environment_factory_class(openenv_server: Server) -> None:
    transformers = framework("transformers")
    from birdenv.integrations.openenv import BirdOpenEnvTRLEnv
    from birdenv.tools import TOOL_SCHEMAS

    before = openenv_server.leases()
    env = BirdOpenEnvTRLEnv(base_url=openenv_server.url)
    schemas = [
        transformers.utils.get_json_schema(f) for f in (env.execute_sql, env.submit_solution)
    ]
    assert schemas == TOOL_SCHEMAS  # what TRL shows the model
    assert "# Database Schema:" in env.reset(task_id=TASK_ID, prompt=[])
    assert env.execute_sql("SELECT 1").startswith("status: ok")
    assert env.submit_solution(list(task().sol_sql)).startswith("verdict: success")
    assert env.get_reward() == 1.0
    env.reset(task_id=TASK_ID)
    assert env.get_reward() == 0.0
    # TRL closes no environment: one it drops closes its connection, and the server frees the
    # session of the episode it left open.
    del env
    gc.collect()
    wait_for(lambda: openenv_server.leases() == before, HANG, "the dropped env's session is freed")


def test_skyrl_registers_both_kinds() -> None:
    skyrl_gym = framework("skyrl_gym")
    import birdenv.integrations.skyrl as adapter

    question = birdenv.load_tasks("bird-mini-eval")[0]
    rows = adapter.skyrl_rows("bird")
    assert rows[0] == {
        "prompt": [{"role": "user", "content": ""}],
        "env_class": "BirdSQL-SQLite-v0",
        "task_id": question.instance_id,
    }
    env = skyrl_gym.make(rows[0]["env_class"], env_config={}, extras={**rows[0], "max_turns": 3})
    conversation, metadata = env.init(
        [{"role": "system", "content": "Be brief."}, *rows[0]["prompt"]]
    )
    assert conversation[0] == {"role": "system", "content": "Be brief."}
    assert (
        question.question in conversation[1]["content"]
        and metadata["task_id"] == question.instance_id
    )
    output = env.step(format_tool_call("submit_solution", sql_list=[question.SQL]))
    assert output["done"] and output["reward"] == 1.0
    assert env.get_metrics() == {"passed": 1.0, "turns": 1}
    env.close()


def test_the_documented_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/integrations.md's blocks that need a framework (marked for this lane) run as written."""
    import re

    framework("verl")
    framework("skyrl_gym")
    text = (ROOT / "docs" / "integrations.md").read_text()
    marked = re.compile(
        r"<!-- not run: [^>]*adapters lane of make test runs it[^>]*-->\n```python\n(.*?)^```",
        re.M | re.S,
    )
    blocks = marked.findall(text)
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "docs/integrations.md", "exec"), {"__name__": "__main__"})
    assert (tmp_path / "train.parquet").exists()


def test_a_dropped_trl_environment_frees_its_session() -> None:
    """TRL's environments are never closed: one that TRL drops mid-episode frees its session."""
    import gc

    from birdenv.integrations.trl import BirdCriticTRLEnv

    before = local_leases()
    env = BirdCriticTRLEnv(suite=SUITE)
    env.reset(task_id=TASK_ID)
    assert env.execute_sql("CREATE TABLE probe AS SELECT 42 AS answer").startswith("status: ok")
    assert local_leases() == before + 1
    del env
    gc.collect()
    assert local_leases() == before

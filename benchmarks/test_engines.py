"""The evaluation engines side by side: ``birdtrain eval`` on critic-mini with SmolLM2-135M under
``--engine vllm`` and ``--engine transformers``, in agent and single mode, both in bfloat16.

Each measurement is a whole ``birdtrain eval`` command as a user runs it (start-up, the engine's
start, generation, the environment and the judge); the summary's time split gives generation
alone. The engines alternate in one run, so a load from elsewhere on the machine falls on both.
Needs vLLM (on a CPU, the ``.venv-vllm`` environment ``make install-vllm`` builds):
``.venv-vllm/bin/python -m pytest benchmarks/test_engines.py --benchmark-only -m slow -s``;
figures in benchmarks/README.md ("Evaluation engines"). Also a CPU engine's thread binding, vLLM's
own against every core ("vLLM on a small CPU").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm extra (on a CPU: make install-vllm)")

# Minutes each on a 2-core CPU: outside the default benchmark set.
pytestmark = pytest.mark.slow

TASKS = 4
#: Seconds each command took, by (mode, engine), for the ratio printed at the end.
SECONDS: dict[tuple[str, str], dict[str, float]] = {}


@pytest.mark.parametrize("mode", ["agent", "single"])
@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_eval_engine(benchmark, tmp_path: Path, mode: str, engine: str) -> None:
    cmd = [
        *(sys.executable, "-m", "birdtrain", "eval", "--policy", "smollm"),
        *("--suite", "critic-mini", "--limit", str(TASKS), "--mode", mode),
        *("--engine", engine, "--dtype", "bfloat16", "--enforce-eager"),
        *("--max-turns", "3", "--max-new-tokens", "128", "--num-envs", "4"),
        *("--max-context", "8192", "--out", str(tmp_path)),
    ]

    def run() -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    start = time.perf_counter()
    benchmark.pedantic(run, rounds=1, iterations=1)
    wall = time.perf_counter() - start
    split = json.loads((tmp_path / "summary.json").read_text())["time_split"]
    SECONDS[(mode, engine)] = {"wall": wall, "generation": split["generation_s"]}
    benchmark.extra_info.update(SECONDS[(mode, engine)])
    other = SECONDS.get((mode, "vllm" if engine == "transformers" else "transformers"))
    if other is not None:
        vllm, transformers = (
            (other, SECONDS[(mode, engine)])
            if engine == "transformers"
            else (SECONDS[(mode, engine)], other)
        )
        print(
            f"\n{mode}: transformers / vllm = {transformers['wall'] / vllm['wall']:.2f} (wall), "
            f"{transformers['generation'] / vllm['generation']:.2f} (generation); "
            f"vllm {vllm['wall']:.0f} s ({vllm['generation']:.0f} s generating), "
            f"transformers {transformers['wall']:.0f} s ({transformers['generation']:.0f} s)"
        )


#: Seconds a round took, by scheme, for the ratio printed at the end.
ROUND: dict[str, float] = {}


@pytest.mark.parametrize("scheme", ["one engine per evaluation", "one engine per round"])
def test_evaluation_round_engines(benchmark, tmp_path: Path, scheme: str) -> None:
    """A curriculum's evaluation round, four evaluations of one policy (fit and held out, agent
    and single mode) on vLLM: each starting its own engine (the naive scheme), against one engine
    for the round (``birdtrain.evaluate.sharing_engines``, what the curriculum does)."""
    import contextlib

    from birdenv.tasks import load_tasks
    from birdtrain.evaluate import evaluate_policy, sharing_engines
    from birdtrain.models import resolve_model

    smollm = resolve_model("smollm")
    tasks = load_tasks("critic-mini")
    rounds = [
        (tasks[:TASKS], "agent"),
        (tasks[:TASKS], "single"),
        (tasks[TASKS : 2 * TASKS], "agent"),
        (tasks[TASKS : 2 * TASKS], "single"),
    ]
    settings = {
        "engine": "vllm",
        "dtype": "bfloat16",
        "engine_options": {"enforce_eager": True, "max_model_len": 8192},
        "max_turns": 3,
        "max_new_tokens": 128,
        "num_envs": 4,
    }

    def run() -> None:
        scope = sharing_engines() if scheme.endswith("round") else contextlib.nullcontext()
        with scope:
            for i, (part, mode) in enumerate(rounds):
                evaluate_policy(
                    smollm, tasks=part, out_dir=tmp_path / str(i), mode=mode, **settings
                )

    start = time.perf_counter()
    benchmark.pedantic(run, rounds=1, iterations=1)
    ROUND[scheme] = time.perf_counter() - start
    built = [json.loads((tmp_path / str(i) / "summary.json").read_text()) for i in range(4)]
    benchmark.extra_info.update(
        seconds=ROUND[scheme], engines_built=sum(s["engines_built"] for s in built)
    )
    if len(ROUND) == 2:
        naive, shared = ROUND["one engine per evaluation"], ROUND["one engine per round"]
        print(
            f"\nevaluation round: {naive:.0f} s with an engine each, {shared:.0f} s with one "
            f"engine: {naive - shared:.0f} s saved ({naive / shared:.2f}x)"
        )


#: Tokens a second decoded, by binding, for the ratio printed at the end.
DECODED: dict[str, float] = {}
#: One batch decoded by a CPU engine in its own worker process, as an evaluation's engine runs.
_DECODE = """
import json, sys, time
from birdtrain.models import resolve_model
from birdtrain.policies import bind_cpu_engine
from vllm import LLM, SamplingParams

bind_cpu_engine()  # keeps a binding the environment sets
llm = LLM(model=resolve_model("qwen-coder-0.5b"), enforce_eager=True, dtype="float32",
          kv_cache_memory_bytes=2 << 30, max_model_len=4096)
prompts = [f"-- query {i}\\nSELECT customer_id, SUM(amount) FROM orders WHERE" for i in range(16)]
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))
start = time.perf_counter()
out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
seconds = time.perf_counter() - start
print(json.dumps({"tokens": sum(len(o.outputs[0].token_ids) for o in out), "seconds": seconds}))
"""


@pytest.mark.parametrize("binding", ["auto", "every core"])
def test_cpu_engine_binding(benchmark, binding: str) -> None:
    """16 sequences of 128 tokens decoded by Qwen2.5-Coder-0.5B in float32 on a CPU of up to four
    cores: vLLM's own binding (``auto``: one core kept for its scheduler, the engine's threads on
    the rest) against every core (:func:`birdtrain.policies.bind_cpu_engine`, what evaluations
    do). The engine in a worker process of its own, as ``birdtrain eval`` runs it."""
    if len(os.sched_getaffinity(0)) > 4:
        pytest.skip("bind_cpu_engine keeps vLLM's binding past four CPUs")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if binding == "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    result: dict[str, float] = {}

    def run() -> None:
        proc = subprocess.run(
            [sys.executable, "-c", _DECODE], env=env, check=True, capture_output=True, text=True
        )
        # vLLM logs to stdout too: the result is the line the script prints.
        line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith('{"tokens"'))
        result.update(json.loads(line))

    benchmark.pedantic(run, rounds=1, iterations=1)
    DECODED[binding] = result["tokens"] / result["seconds"]
    benchmark.extra_info.update(tokens_per_s=DECODED[binding])
    if len(DECODED) == 2:
        print(
            f"\ndecoding: {DECODED['every core']:.1f} tokens/s on every core, "
            f"{DECODED['auto']:.1f} with vLLM's binding "
            f"({DECODED['every core'] / DECODED['auto']:.2f}x)"
        )

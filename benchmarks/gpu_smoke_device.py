"""The GPU check's device mode: the paper's training path on one GPU with no network at all.

For a machine whose image already holds CUDA's PyTorch and transformers but cannot reach a package
index (``benchmarks/gpu_smoke.sh --device``; ``docs/gpu.md``, "The GPU check", says how it is
started). The packages the train path lacks there travel as CPython 3.12 wheels in ``.whl/``
(``make device-wheels``); they are installed with ``pip install --no-index --no-deps --target``
into a scratch folder beside the image's own Python (no virtual environment, which would hide the
image's torch), and the project runs from its folder on ``PYTHONPATH`` (its C extensions are
optional: without them birdenv copies databases instead of cloning them).

``run [--dry-run] [--budget SECONDS] [OUT_DIR]`` checks, one PASS/FAIL line each, then a JSON
summary. Three processes run them (``prepare``: 2-3; ``stage3``: 4-6, the peak step first in a
fresh process, then the peak counter reset; ``stage4``: 7), so each stage's peak GPU memory is its
own:

1. install: the wheels into the scratch folder;
2. environment: every carried wheel's requirements met by the image, the train path importable,
   one CUDA GPU;
3. ``birdtrain plan``: a random-weight model of Qwen2.5-Coder-7B-Instruct's exact shape (7.62 B
   parameters, a vocabulary of 152,064, bfloat16) is built from a config (no hub), and
   ``birdtrain plan`` plans ``paper-7b`` on it, without vLLM as here;
4. stage 3, one step with completions of the paper's length (5,000 tokens, its micro-batch of 2):
   the peak GPU memory measured against the plan's for the same settings;
5. stage 3, two steps sampled by ``TransformersPolicy`` on the GPU: sampling and training tokens/s;
6. in that run: LoRA trained, gradient checkpointing on, the frozen base (also the KL reference)
   bit-identical after the steps;
7. stage 4, two steps of multi-turn rollouts in async environment workers (worker processes),
   saving the merged checkpoint.

Random weights never earn a reward, and a group whose rewards are all equal has no advantage:
nothing would train. So the verdicts vary by construction (:class:`Planted`): the model samples
every rollout, and in each GRPO group every second rollout's turn is then replaced by the task's
gold answer (stage 3: its ``<solution>``; stage 4: ``submit_solution`` with the gold statements),
which the judge passes; the sampled ones fail. Without vLLM, TRL scores every completion with
the trained model itself, so the loss is computed on these tokens like on sampled ones.

Every log and ``summary.json`` go to ``OUT_DIR`` (default ``$OUT``, the folder a device call
brings back: at most 8 files, so one log per check). The model and the checkpoints go to a scratch
folder (``/dev/shm`` when it has room), removed at the end. The whole run keeps within
``--budget`` seconds (default 450: one device command may run 8 minutes); a check that would
start past it fails as not run. The dry run's budget and timeouts are ``DRY_RUN_SLACK`` times
those: on a CPU they bound a hang, not the machine's speed.

``--dry-run``: the same checks on this CPU with a tiny model of the same architecture (its
vocabulary larger than the tokenizer's, as Qwen's), the running environment's packages (no
install) and no memory figures. ``tests/test_gpu_device.py`` runs it in ``make test``'s vLLM lane,
whose transformers (5.17) and TRL (1.16) are the device image's.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
GB = 1e9
#: Seconds the whole run may take by default: one device command runs at most 8 minutes.
BUDGET_S = 450
#: The settings every check trains with: ``paper-7b`` as the device runs it. No vLLM there
#: (TransformersPolicy samples); dynamic sampling off, since every group's verdicts vary
#: (:class:`Planted`) and a replacement round would only make a step's time unpredictable.
COMMON = (
    "model.lora=true",
    "model.dtype=bfloat16",
    "model.gradient_checkpointing=true",
    "stage3.use_vllm=false",
    "stage4.use_vllm=false",
    "stage3.dynamic_sampling_rounds=0",
    "stage4.dynamic_sampling_rounds=0",
)
#: Each training check's own settings on top of :data:`COMMON`.
CHECKS = {
    # One micro-batch (paper-7b's 2 sequences) of completions of the paper's 5,000 tokens.
    "stage3_peak": ("stage3.prompts_per_step=1", "stage3.num_generations=2", "stage3.max_steps=1"),
    # Two steps of one group of 8 sampled completions (4 micro-batches a step).
    "stage3_speed": (
        "stage3.prompts_per_step=1",
        "stage3.num_generations=8",
        "stage3.max_completion_length=512",
        "stage3.max_steps=2",
    ),
    # Two steps of one task's group of 4 rollouts, up to 2 turns of 128 tokens; one worker
    # process per rollout, so a group's first turns are sampled in one batch.
    "stage4": (
        "stage4.tasks_per_step=1",
        "stage4.num_generations=4",
        "stage4.num_envs=4",
        "stage4.vector=async",
        "stage4.max_turns=2",
        "stage4.max_new_tokens=128",
        "stage4.max_steps=2",
    ),
}
#: The dry run's lengths on top of each check's: the device's would take minutes on a CPU (the
#: prompts show only the tables a task names, without rows: ~500 tokens instead of ~2,000).
DRY_RUN = {
    "stage3_peak": ("stage3.max_completion_length=600",),
    # Groups of 2 (one sampled, one planted); a turn holds the gold answer (~100 tokens).
    "stage3_speed": ("stage3.max_completion_length=128", "stage3.num_generations=2"),
    "stage4": ("stage4.num_generations=2", "stage4.num_envs=2"),
}
DRY_RUN_PROMPTS = ("prompt.schema=named", "prompt.sample_rows=false")
#: Seconds each process may take at most (the budget caps them all).
TIMEOUTS = {"install": 90, "prepare": 180, "stage3": 240, "stage4": 180, "chained": 600}
#: The dry run checks the code path on whatever CPU runs it, loaded or not (under two CPU hogs
#: per core its processes took 451 s, the device's whole budget): its budget and timeouts are
#: this many times the device's, bounds for a hang, not for the machine's speed.
DRY_RUN_SLACK = 8
#: What the train path imports beyond the image's torch and transformers.
TRAIN_MODULES = ("trl", "peft", "datasets", "duckdb", "gymnasium", "sqlglot", "accelerate")


# -- the checks' processes (each prints a RESULT line per result) -------------------------------


def _config(model: str, out: str, check: str, form: str) -> Any:
    """``paper-7b`` as ``check`` runs it on ``model``; ``form``: ``device``, or ``dry-run``
    (:data:`DRY_RUN`'s lengths)."""
    from birdtrain.config import load_config

    overrides = [f"model.name_or_path={model}", f"output_dir={out}", *COMMON, *CHECKS[check]]
    if form == "dry-run":
        overrides += [*DRY_RUN_PROMPTS, *DRY_RUN[check]]
    return load_config("paper-7b", overrides=overrides)


def _tasks() -> list[Any]:
    from birdenv.tasks import load_tasks

    return load_tasks("critic-mini")[:2]


def _gold(kind: str) -> Callable[[Any], str]:
    """The gold answer of a task as a stage's rollout writes it."""
    if kind == "stage3":
        from birdtrain.prompts import format_answer

        return lambda task: format_answer("The gold fix.", list(task.sol_sql))
    from birdenv.tools import format_tool_call

    return lambda task: format_tool_call("submit_solution", sql_list=list(task.sol_sql))


class Planted:
    """A stage's ``policy(trainer)`` hook: the stage's own sampler (``TransformersPolicy`` here,
    :func:`~birdtrain.stages.training.stage_actor`) with the judge's variance planted (see the
    module's docstring). Among the contexts of one ``generate`` call, every second occurrence of the same
    context (a GRPO group's rollouts share their first context) gets the gold answer of its task
    instead of what was sampled. A rollout's later turns have contexts of their own and are left
    as sampled. With ``full_length`` nothing is sampled: every completion is ``max_new_tokens``
    ids drawn at random from the part of the vocabulary past the tokenizer (they decode to
    nothing), a planted one ending in the gold answer; a step then trains on completions of
    exactly the configured length.

    The stage calls the hook at every step; the sampler is made at the first call and kept, so
    the counts of what it sampled (``sampled_tokens``, ``sampling_s``) cover every step. Other
    attributes are the sampler's (``tokenizer``, ``eos_ids``, ``turns``).
    """

    def __init__(self, tasks: list[Any], kind: str, *, full_length: bool = False) -> None:
        self.inner: Any = None
        self.tasks = tasks
        self.gold = _gold(kind)
        self.full_length = full_length
        self.vocab_size = 0
        self.sampled_tokens = 0
        self.sampling_s = 0.0
        self.planted = 0

    def __call__(self, trainer: Any) -> Planted:
        if self.inner is None:
            from birdtrain.stages.training import stage_actor

            self.inner = stage_actor(trainer)
            self.vocab_size = trainer.model.get_input_embeddings().num_embeddings
        return self

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _task(self, context: list[int]) -> Any:
        text = self.inner.tokenizer.decode(context, skip_special_tokens=False)
        return next(t for t in self.tasks if t.query in text)

    def _filler(self, count: int) -> list[int]:
        import torch

        low = len(self.inner.tokenizer)
        return torch.randint(low, self.vocab_size, (max(count, 0),)).tolist()

    def generate(
        self, batch: list[list[int]], *, max_new_tokens: int, temperature: float
    ) -> list[tuple[list[int], list[float]]]:
        """One turn for every context of ``batch``; every second repeat of a context is planted."""
        tokenizer = self.inner.tokenizer
        if self.full_length:
            out = [(self._filler(max_new_tokens), [0.0] * max_new_tokens) for _ in batch]
        else:
            start = time.perf_counter()
            out = self.inner.generate(batch, max_new_tokens=max_new_tokens, temperature=temperature)
            self.sampling_s += time.perf_counter() - start
            self.sampled_tokens += sum(len(ids) for ids, _ in out)
        seen: Counter[tuple[int, ...]] = Counter()
        for k, context in enumerate(batch):
            seen[tuple(context)] += 1
            if seen[tuple(context)] % 2:
                continue
            ids = [*tokenizer.encode(self.gold(self._task(context))), tokenizer.eos_token_id]
            if len(ids) > max_new_tokens:  # cut, it would fail the judge: no variance after all
                raise ValueError(
                    f"the gold answer takes {len(ids)} tokens, more than the {max_new_tokens} of a "
                    "turn: raise the check's length"
                )
            if self.full_length:
                ids = self._filler(max_new_tokens - len(ids)) + ids
            # Without vLLM TRL recomputes every log-probability with the trained model; these
            # only fill the column.
            out[k] = (ids, [0.0] * len(ids))
            self.planted += 1
        return out


def _peak() -> dict[str, float] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return {
        "allocated_gb": torch.cuda.max_memory_allocated() / GB,
        "reserved_gb": torch.cuda.max_memory_reserved() / GB,
    }


def _gpu_gb() -> float:
    """The card's memory in GB; 80 (the paper's card) without one."""
    import torch

    if not torch.cuda.is_available():
        return 80.0
    return torch.cuda.get_device_properties(0).total_memory / GB


def _planned(cfg: Any, stage: str) -> dict[str, Any]:
    from birdtrain.plan import plan

    gpu_gb = _gpu_gb()
    (stage_plan,) = [p for p in plan(cfg, gpu_gb=gpu_gb) if p.stage == stage]
    return {"peak_gb": stage_plan.peak, "fits": stage_plan.fits, "gpu_gb": gpu_gb}


def _speeds(records: list[dict[str, Any]], policy: Planted, other_s: float = 0.0) -> dict:
    """Sampling tokens/s (what ``policy`` sampled over its time) and training tokens/s (the
    sequences TRL trained on over the steps' time less sampling and ``other_s``, the
    environment's)."""
    steps = [r for r in records if "loss" in r]
    tokens = max(r["num_tokens"] for r in steps)
    train_s = sum(r["step_time"] for r in steps) - policy.sampling_s - other_s
    return {
        "sampled_tokens": policy.sampled_tokens,
        "sampling_s": policy.sampling_s,
        "sampling_tokens_per_s": policy.sampled_tokens / policy.sampling_s,
        "trained_tokens": tokens,
        "training_s": train_s,
        "training_tokens_per_s": tokens / train_s,
    }


def stage3_peak(model: str, out: str, form: str) -> dict[str, Any]:
    """One stage-3 step on completions of the paper's length; the peak GPU memory and the plan's."""
    from birdtrain.stages import grpo
    from birdtrain.stages.training import train

    cfg = _config(model, out, "stage3_peak", form)
    tasks = _tasks()
    sampler = Planted(tasks, "stage3", full_length=True)
    trainer = grpo.build_trainer(
        cfg, model_path=model, out_dir=Path(out) / "s3", tasks=tasks, policy=sampler
    )
    start = time.perf_counter()
    train(trainer)
    steps = [r for r in trainer.state.log_history if "loss" in r]
    return {
        "steps": trainer.state.global_step,
        "seconds": time.perf_counter() - start,
        "completion_length": steps[0]["completions/max_length"],
        "max_completion_length": cfg.stage3.max_completion_length,
        "rewards": [r["reward"] for r in steps],
        "reward_std": [r["reward_std"] for r in steps],
        "peak": _peak(),
        "plan": _planned(cfg, "stage3"),
    }


def stage3_speed(model: str, out: str, form: str) -> dict[str, Any]:
    """Two stage-3 steps sampled by TransformersPolicy: tokens/s, and LoRA, gradient
    checkpointing and the frozen base (the KL reference) checked around them."""
    import torch

    from birdtrain.policies import unwrapped
    from birdtrain.stages import grpo
    from birdtrain.stages.precision import training_precision
    from birdtrain.stages.training import train

    cfg = _config(model, out, "stage3_speed", form)
    tasks = _tasks()
    policy = Planted(tasks, "stage3")
    trainer = grpo.build_trainer(
        cfg, model_path=model, out_dir=Path(out) / "s3", tasks=tasks, policy=policy
    )
    peft_model = trainer.model
    # The base on the host: a second copy of 15 GB on the GPU would change the peak it reports.
    base = {
        n: p.detach().to("cpu", copy=True)
        for n, p in peft_model.named_parameters()
        if "lora_" not in n
    }
    device = next(peft_model.parameters()).device
    probe = torch.tensor(
        [trainer.processing_class.encode("SELECT name FROM customers WHERE")], device=device
    )
    with torch.no_grad(), peft_model.disable_adapter():
        reference = peft_model(probe).logits
    start = time.perf_counter()
    train(trainer)
    seconds = time.perf_counter() - start
    with torch.no_grad(), peft_model.disable_adapter():
        reference_kept = torch.equal(peft_model(probe).logits, reference)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    steps = [r for r in trainer.state.log_history if "loss" in r]
    return {
        "steps": trainer.state.global_step,
        "seconds": seconds,
        "rewards": [r["reward"] for r in steps],
        "reward_std": [r["reward_std"] for r in steps],
        "planted": policy.planted,
        **_speeds(steps, policy),
        "sampler": type(policy.inner).__name__,  # what stage 3 samples with here
        "device": str(device),
        "base_dtypes": sorted({str(p.dtype) for p in base.values()}),
        # bfloat16 on a GPU; float32 in a dry run on a CPU without native bfloat16.
        "rule_base_dtype": f"torch.{training_precision(cfg.model.dtype, lora=True).weights}",
        "base_changed": [
            n
            for n, p in peft_model.named_parameters()
            if n in base and not torch.equal(p.detach().cpu(), base[n])
        ],
        "reference_kept": reference_kept,
        "only_lora_trains": bool(trainable) and all("lora_" in n for n in trainable),
        "adapters_trained": any(
            p.abs().max().item() > 0 for n, p in peft_model.named_parameters() if "lora_B" in n
        ),
        "gradient_checkpointing": bool(unwrapped(peft_model).is_gradient_checkpointing),
        "peak": _peak(),
        "plan": _planned(cfg, "stage3"),
    }


def _checkpoint_parameters(folder: Path) -> tuple[int, list[str]]:
    """Parameters in a checkpoint's safetensors files (read from their headers), and any name
    that is an adapter's."""
    from safetensors import safe_open

    total, adapters = 0, []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle is no mapping
                total += math.prod(f.get_slice(name).get_shape())
                if "lora_" in name:
                    adapters.append(name)
    return total, adapters


def stage4(model: str, out: str, form: str) -> dict[str, Any]:
    """Two stage-4 steps of multi-turn rollouts in async environment workers; the merged
    checkpoint saved."""
    from birdtrain.stages import agentic

    cfg = _config(model, out, "stage4", form)
    tasks = _tasks()
    policy = Planted(tasks, "stage4")
    start = time.perf_counter()
    checkpoint = agentic.run(
        cfg, model_path=model, out_dir=Path(out) / "s4", tasks=tasks, policy=policy
    )
    seconds = time.perf_counter() - start
    lines = (Path(out) / "s4" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "loss" in r]
    parameters, adapters = _checkpoint_parameters(Path(checkpoint))
    return {
        "steps": [r["step"] for r in steps],
        "seconds": seconds,
        "rewards": [r["agentic/reward_mean"] for r in steps],
        "reward_std": [r["agentic/reward_std"] for r in steps],
        "turns": [r["agentic/turns"] for r in steps],
        "planted": policy.planted,
        **_speeds(steps, policy, sum(r["agentic/env_s"] for r in steps)),
        "env_s": sum(r["agentic/env_s"] for r in steps),
        "checkpoint": str(checkpoint),
        "checkpoint_parameters": parameters,
        "checkpoint_adapters": adapters,
        "peak": _peak(),
        "plan": _planned(cfg, "stage4"),
    }


def carried_wheels(wheels: Path) -> tuple[dict[str, str], list[str]]:
    """The distributions the wheels in ``wheels`` carry (name → version), and what is wrong with
    them where this runs: a carried version that is not the one imported (an older copy earlier
    on the path), a requirement missing or of a version outside its bounds. Markers are
    evaluated (a requirement only for an extra, or another Python, is not one)."""
    import importlib.metadata as metadata

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    here = {**default_environment(), "extra": ""}
    carried: dict[str, str] = {}
    problems = []
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
            meta = archive.read(name).decode()
        # The header of METADATA: one "Field: value" a line, up to the blank line before the text.
        fields = [line.split(": ", 1) for line in meta.split("\n\n")[0].splitlines()]
        dist = next(v for k, v in fields if k == "Name")
        carried[dist] = next(v for k, v in fields if k == "Version")
        try:
            found = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found = "none"
        if found != carried[dist]:
            problems.append(f"{dist} {carried[dist]} carried, {found} imported")
        for spec in (v for k, v in fields if k == "Requires-Dist"):
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate(here):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{dist} needs {req}: missing")
                continue
            if not req.specifier.contains(have, prereleases=True):
                problems.append(f"{dist} needs {req}: {have} here")
    return carried, problems


def environment(wheels: str) -> dict[str, Any]:
    """What the image and the carried wheels in ``wheels`` (none: ``""``) make: what
    :func:`carried_wheels` finds wrong, the train path importable, the versions and the GPU."""
    import importlib

    carried, problems = carried_wheels(Path(wheels)) if wheels else ({}, [])
    versions = {}
    for module in ("torch", "transformers", *TRAIN_MODULES, "pyarrow", "fsspec"):
        try:
            versions[module] = importlib.import_module(module).__version__
        except Exception as exc:  # an import that fails is what this check reports
            problems.append(f"import {module}: {type(exc).__name__}: {exc}")
    for module in ("birdtrain.stages.grpo", "birdtrain.stages.agentic", "birdtrain.plan"):
        try:
            importlib.import_module(module)
        except Exception as exc:
            problems.append(f"import {module}: {type(exc).__name__}: {exc}")
    import torch

    gpus = torch.cuda.device_count()
    return {
        "python": sys.version.split()[0],
        "versions": versions,
        "carried": carried,
        "problems": problems,
        "gpus": gpus,
        "gpu": torch.cuda.get_device_name(0) if gpus else None,
        "gpu_gb": _gpu_gb() if gpus else None,
    }


def prepare(wheels: str, model: str, shape: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """:func:`environment`; then the random-weight model of ``shape``, and ``birdtrain plan`` of
    ``paper-7b`` on it as the checks run it (no vLLM), on this GPU (80 GB without one)."""
    yield "environment", environment(wheels)
    from gpu_smoke import build

    from birdtrain.cli import main

    built = build(model, shape)
    gpu_gb = _gpu_gb()
    plan_args = ["plan", "--preset", "paper-7b", "--gpu-gb", f"{gpu_gb:.1f}"]
    overrides = [f"model.name_or_path={model}", *COMMON]
    print("$ birdtrain " + " ".join(plan_args + overrides), flush=True)
    status = main(plan_args + overrides)
    yield "prepare", {**built, "plan_exit": status, "gpu_gb": gpu_gb}


def stage3(model: str, out: str, form: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """:func:`stage3_peak`, then :func:`stage3_speed` in the same process (one start less) once
    the first trainer's memory is given back and the peak counter reset."""
    import gc

    import torch

    yield "stage3_peak", stage3_peak(model, str(Path(out) / "peak"), form)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield "stage3_speed", stage3_speed(model, str(Path(out) / "speed"), form)


def stage4_command(model: str, out: str, form: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """:func:`stage4`."""
    yield "stage4", stage4(model, out, form)


def chained(wheels: str, model: str, shape: str, work: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """:func:`prepare`, :func:`stage3` and :func:`stage4` in one process: the dry run's, as each
    process on a CPU spends ~25 s of CPU importing torch, transformers and TRL."""
    yield from prepare(wheels, model, shape)
    yield from stage3(model, str(Path(work) / "s3"), "dry-run")
    yield from stage4_command(model, str(Path(work) / "s4"), "dry-run")


#: The checks' processes: each yields its results by name; each is printed as a RESULT line.
COMMANDS: dict[str, Callable[..., Iterator[tuple[str, dict[str, Any]]]]] = {
    "prepare": prepare,
    "stage3": stage3,
    "stage4": stage4_command,
    "chained": chained,
}


# -- the driver ---------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In a check's process, before it runs: killed when the driver dies (killed at a runner's
    time limit, say), rather than left running on its own."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


class Driver:
    """Runs the checks in order within the budget; collects their lines and results."""

    def __init__(
        self, out: Path, scratch: Path, budget_s: float, env: dict[str, str], slack: float = 1
    ) -> None:
        self.out = out
        self.scratch = scratch
        self.deadline = time.monotonic() + budget_s
        self.slack = slack  # each process's timeout: its TIMEOUTS entry times this
        self.env = env
        self.checks: list[dict[str, Any]] = []
        self.results: dict[str, Any] = {}
        self.lines: list[str] = []

    def say(self, name: str, status: str, detail: str = "") -> None:
        """One check's line (printed, and kept for ``checks.txt``)."""
        line = f"{status} {name}" + (f": {detail}" if detail else "")
        print(line, flush=True)
        self.lines.append(line)
        self.checks.append({"check": name, "status": status, "detail": detail})

    def run(
        self, step: str, command: list[str], *, prints_result: bool = True
    ) -> tuple[dict[str, Any] | None, str]:
        """``command`` in a process group of its own, its output in ``OUT/STEP.log``, killed with
        its children (environment workers) at its timeout, or when this process dies. Its RESULT lines' objects are merged
        into :attr:`results` whatever its exit (a process that failed half-way keeps what it had
        found). Returns them merged (``{}`` for a command that ``prints_result=False`` and exits
        0), or None and why."""
        left = self.deadline - time.monotonic()
        if left < 10:
            return None, "not run: the time budget is spent"
        timeout = min(TIMEOUTS[step] * self.slack, left)
        log = self.out / f"{step}.log"
        start = time.monotonic()
        with log.open("a") as sink:
            sink.write("$ " + " ".join(command) + "\n")
            sink.flush()
            proc = subprocess.Popen(
                command,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=ROOT,
                process_group=0,
                preexec_fn=_die_with_parent,
            )
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
        seconds = time.monotonic() - start
        self.results.setdefault("seconds", {})[step] = round(seconds, 1)
        if code is None:
            return None, f"timed out after {timeout:.0f} s, see {log.name}"
        found: dict[str, Any] = {}
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("RESULT "):
                found.update(json.loads(line.removeprefix("RESULT ")))
        self.results.update(found)
        if code != 0 or (prints_result and not found):
            return None, f"exit {code}, see {log.name}"
        return found, ""

    def child(self, step: str, *args: str) -> tuple[dict[str, Any] | None, str]:
        """One of :data:`COMMANDS` in a process of its own."""
        return self.run(step, [sys.executable, str(Path(__file__).resolve()), step, *args])


def _scratch(need_gb: float) -> Path:
    """A folder for the model and the checkpoints: in memory (``/dev/shm``) when it has room, as
    writing and reading 15 GB there takes seconds, else the temporary folder."""
    for base in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(base) and shutil.disk_usage(base).free >= need_gb * GB:
            return Path(tempfile.mkdtemp(prefix="gpu-check-", dir=base))
    return Path(tempfile.mkdtemp(prefix="gpu-check-"))


def _mem(result: dict[str, Any]) -> str:
    peak = result["peak"]
    return (
        f"{peak['allocated_gb']:.1f} GB allocated, {peak['reserved_gb']:.1f} GB reserved; "
        f"plan {result['plan']['peak_gb']:.1f} GB of {result['plan']['gpu_gb']:.0f}"
    )


def _memory_check(driver: Driver, name: str, result: dict[str, Any] | None) -> None:
    """PASS when the allocator's peak stays within the plan's peak and what it reserved within
    the share of the card the plan leaves itself (90 %)."""
    if result is None:
        driver.say(name, "FAIL", "no figure: its stage failed")
    elif result["peak"] is None:
        driver.say(name, "SKIP", "no CUDA device (dry run): nothing measured")
    else:
        peak, plan = result["peak"], result["plan"]
        ok = peak["allocated_gb"] <= plan["peak_gb"] and peak["reserved_gb"] <= 0.9 * plan["gpu_gb"]
        driver.say(name, "PASS" if ok else "FAIL", _mem(result))


def _varied(result: dict[str, Any]) -> bool:
    return all(std > 0 for std in result["reward_std"])


def _install(driver: Driver, wheels: list[Path], dry_run: bool) -> None:
    if dry_run:
        driver.say("install", "SKIP", "dry run: the running environment's packages")
        return
    if not wheels:
        driver.say("install", "FAIL", "no wheels in .whl/: run make device-wheels")
        return
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile"]
    command += ["--no-cache-dir", "--target", str(driver.scratch / "site"), *map(str, wheels)]
    installed, why = driver.run("install", command, prints_result=False)
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    if installed is None:
        driver.say("install", "FAIL", why)
    else:
        driver.say("install", "PASS", f"{len(wheels)} wheels ({mib:.1f} MiB) beside the image's")


def _environment(driver: Driver, env: dict[str, Any] | None, why: str, dry_run: bool) -> None:
    if env is None:
        driver.say("environment", "FAIL", why)
        return
    v = env["versions"]
    detail = (
        f"Python {env['python']}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
        f"trl {v.get('trl')}, peft {v.get('peft')}, datasets {v.get('datasets')}, pyarrow "
        f"{v.get('pyarrow')}, fsspec {v.get('fsspec')}; {env['gpu'] or 'no GPU'}"
    )
    problems = list(env["problems"])
    if not dry_run and env["gpus"] != 1:
        problems.append(f"{env['gpus']} CUDA devices, not one")
    driver.say("environment", "FAIL" if problems else "PASS", "; ".join([detail, *problems]))


def _stage3_lines(driver: Driver, why: str, dry_run: bool) -> None:
    peak = driver.results.get("stage3_peak")
    name = "stage 3, one step, completions of the paper's length"
    if peak is None:
        driver.say(name, "FAIL", why)
    else:
        full = peak["completion_length"] == peak["max_completion_length"]
        driver.say(
            name,
            "PASS" if peak["steps"] == 1 and full and _varied(peak) else "FAIL",
            f"{peak['completion_length']:.0f} tokens a completion "
            f"(max {peak['max_completion_length']}), reward std {peak['reward_std']}, "
            f"{peak['seconds']:.0f} s",
        )
    _memory_check(driver, "stage 3 peak GPU memory within the plan", peak)

    speed = driver.results.get("stage3_speed")
    name = "stage 3, two steps sampled by TransformersPolicy"
    invariants = "LoRA, gradient checkpointing, frozen base bit-identical"
    if speed is None:
        driver.say(name, "FAIL", why)
        driver.say(invariants, "FAIL", "stage 3 failed")
        return
    on_gpu = dry_run or speed["device"].startswith("cuda")
    base_dtype = speed["rule_base_dtype"] if dry_run else "torch.bfloat16"
    ok = speed["steps"] == 2 and speed["sampler"] == "TransformersPolicy" and on_gpu
    driver.say(
        name,
        "PASS" if ok and _varied(speed) else "FAIL",
        f"on {speed['device']}: sampling {speed['sampling_tokens_per_s']:,.0f} tokens/s "
        f"({speed['sampled_tokens']:,} in {speed['sampling_s']:.1f} s), training "
        f"{speed['training_tokens_per_s']:,.0f} tokens/s ({speed['trained_tokens']:,.0f} in "
        f"{speed['training_s']:.1f} s), reward std {speed['reward_std']}",
    )
    wrong = [
        what
        for what, ok in (
            ("no adapter moved", speed["adapters_trained"]),
            ("more than the adapters trains", speed["only_lora_trains"]),
            ("gradient checkpointing off", speed["gradient_checkpointing"]),
            (f"base in {speed['base_dtypes']}", speed["base_dtypes"] == [base_dtype]),
            (f"base changed: {speed['base_changed'][:5]}", not speed["base_changed"]),
            ("the reference's logits changed", speed["reference_kept"]),
        )
        if not ok
    ]
    driver.say(
        invariants,
        "FAIL" if wrong else "PASS",
        "; ".join(wrong)
        or f"adapters trained, checkpointing on, {base_dtype.removeprefix('torch.')} base and "
        "reference unchanged",
    )


def _stage4_line(driver: Driver, why: str) -> None:
    s4 = driver.results.get("stage4")
    name = "stage 4, two steps of multi-turn rollouts in async env workers"
    if s4 is None:
        driver.say(name, "FAIL", why)
        return
    ok = (
        s4["steps"] == [1, 2]
        and _varied(s4)
        and s4["checkpoint_parameters"] == driver.results["prepare"]["parameters"]
        and not s4["checkpoint_adapters"]
    )
    driver.say(
        name,
        "PASS" if ok else "FAIL",
        f"rewards {s4['rewards']} (std {s4['reward_std']}), sampling "
        f"{s4['sampling_tokens_per_s']:,.0f} tokens/s, training {s4['training_tokens_per_s']:,.0f} "
        f"tokens/s, merged checkpoint of {s4['checkpoint_parameters'] / 1e9:.2f} B parameters, "
        f"{s4['seconds']:.0f} s",
    )
    _memory_check(driver, "stage 4 peak GPU memory within the plan", s4)


def check_all(driver: Driver, *, dry_run: bool, wheels: Path) -> None:
    """The checks in order; each says PASS, FAIL or (dry run only) SKIP."""
    found = sorted(wheels.glob("*.whl"))
    _install(driver, found, dry_run)
    model, work = driver.scratch / "model", driver.scratch / "runs"
    carried = str(wheels) if found else ""
    if dry_run:  # one process for all (see chained); each check's line reads its own results
        _, why = driver.child("chained", carried, str(model), "tiny", str(work))
        stage3_why = stage4_why = why
    else:
        _, why = driver.child("prepare", carried, str(model), "qwen2.5-coder-7b")
    _environment(driver, driver.results.get("environment"), why, dry_run)
    prepared = driver.results.get("prepare")
    if prepared is None:
        driver.say("birdtrain plan", "FAIL", why)
        return
    driver.say(
        "birdtrain plan",
        "PASS" if prepared["plan_exit"] == 0 else "FAIL",
        f"paper-7b without vLLM on the random Qwen2 of {prepared['parameters'] / 1e9:.2f} B "
        f"parameters, vocabulary {prepared['vocab_size']:,}: "
        + ("fits" if prepared["plan_exit"] == 0 else "does not fit")
        + f" {prepared['gpu_gb']:.0f} GB (the table: prepare.log)",
    )
    if not dry_run:
        _, stage3_why = driver.child("stage3", str(model), str(work / "s3"), "device")
    _stage3_lines(driver, stage3_why, dry_run)
    if not dry_run:
        _, stage4_why = driver.child("stage4", str(model), str(work / "s4"), "device")
    _stage4_line(driver, stage4_why)


def main_run(args: list[str]) -> int:
    """``run [--dry-run] [--budget SECONDS] [OUT_DIR]``: every check; exit 1 when one failed."""
    dry_run = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    slack = DRY_RUN_SLACK if dry_run else 1
    budget = float(BUDGET_S * slack)
    if "--budget" in args:
        i = args.index("--budget")
        budget = float(args[i + 1])
        del args[i : i + 2]
    target = args[0] if args else os.environ.get("OUT")
    if not target:
        print("give an output folder (or set OUT)", file=sys.stderr)
        return 2
    out = Path(target).resolve()
    out.mkdir(parents=True, exist_ok=True)
    scratch = _scratch(1 if dry_run else 40)
    site = scratch / "site"
    env = {
        **os.environ,
        # the carried wheels first, then the project; the image's own packages after them
        "PYTHONPATH": os.pathsep.join(
            [str(site), str(ROOT), str(ROOT / "benchmarks")]
            + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "BIRDENV_HOME": str(scratch / "home"),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    start = time.monotonic()
    # A runner's SIGTERM ends the run through the cleanup below (the checks' processes die with
    # this one).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    driver = Driver(out, scratch, budget, env, slack)
    print(f"logs: {out}; scratch: {scratch}", flush=True)
    try:
        check_all(driver, dry_run=dry_run, wheels=WHEELS)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    failed = [c["check"] for c in driver.checks if c["status"] == "FAIL"]
    summary = {
        "mode": "dry-run" if dry_run else "device",
        "passed": not failed,
        "failed": failed,
        "wall_s": round(time.monotonic() - start, 1),
        "checks": driver.checks,
        "results": driver.results,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "checks.txt").write_text("\n".join(driver.lines) + "\n")
    print(json.dumps({k: summary[k] for k in ("mode", "passed", "failed", "wall_s")}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "run":
        sys.exit(main_run(rest))
    for key, value in COMMANDS[command](*rest):
        print("RESULT " + json.dumps({key: value}), flush=True)

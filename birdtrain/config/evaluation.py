"""The evaluations' settings: one evaluation (``birdtrain eval``) and the curriculum's."""

from __future__ import annotations

import dataclasses
from typing import Any

from birdtrain.config.fields import STAGES
from birdtrain.config.fields import setting as _field

__all__ = ["EvalConfig", "EvaluationConfig"]


@dataclasses.dataclass
class EvaluationConfig:
    """How one evaluation plays, scores and labels its episodes
    (:func:`birdtrain.evaluate.evaluate_policy`; ``birdtrain eval``'s options).

    The curriculum's evaluations get theirs from :meth:`EvalConfig.evaluation`.
    """

    mode: str = _field(
        "agent",
        "'agent' (tools over several turns, the paper's metric) or 'single' (one <solution>)",
    )
    n: int = _field(1, "samples per task (pass@k for k = 1 and n; n > 1 needs temperature > 0)")
    temperature: float = _field(0.0, "0: greedy")
    max_turns: int = _field(5, "assistant turns per episode (agent mode)")
    max_new_tokens: int = _field(512, "tokens per assistant turn (the whole answer in single mode)")
    num_envs: int = _field(
        8,
        "episodes played at once: the vector env's environments (or worker threads) in agent "
        "mode, the prompts of each generated batch in single mode",
    )
    label: str | None = _field(
        None, "the name results go under; None: the policy's (an endpoint's model, a folder name)"
    )
    suite: str = _field("tasks", "the name of the tasks' suite or file, for the table and summary")
    store_dir: str | None = _field(
        None, "the trajectory store's folder; None: the evaluation's output folder"
    )
    engine: str = _field(
        "auto",
        "a local model's engine: 'vllm', 'transformers', or 'auto' (vLLM when installed and CUDA "
        "is present)",
    )
    prompt: Any = dataclasses.field(
        default=None,
        metadata={
            "help": "the prompt setting (birdenv.schema.PromptOptions, or a mapping of some of its "
            "options over the checkpoint's); None: the one a training stage recorded in the "
            "checkpoint, else the benchmark's full schema. It must be the one the policy was "
            "trained with"
        },
    )
    task_set: str = _field(
        "heldout",
        "'heldout' or 'train': which tasks these are, for the report (the summary's split)",
    )
    ray: bool = _field(
        False,
        "use the Ray cluster at RAY_ADDRESS (else a local Ray): a local model's episodes in a Ray "
        "vector env, single answers judged by Ray workers",
    )
    max_context: int = _field(
        32768, "tokens of context per episode; an agent's episode that fills it ends there"
    )
    engine_options: dict[str, Any] | None = dataclasses.field(
        default=None,
        metadata={
            "help": "keywords of the vLLM engine (gpu_memory_utilization, max_model_len, "
            "enforce_eager)"
        },
    )
    dtype: str = _field(
        "float32",
        "what a local model computes in with the transformers engine ('bfloat16': under autocast, "
        "as a stage trained with it samples)",
    )


@dataclasses.dataclass
class EvalConfig:
    """Evaluation before the curriculum and after the stages it names.

    Each evaluation is written to ``eval/<label>/`` of the run directory (``before``,
    ``after_stage2``, ``after_stage4``, ...), where ``birdtrain report`` finds it.
    """

    enabled: bool = _field(True, "evaluate the policy before and after training")
    before: bool = _field(True, "evaluate the starting model (label 'before')")
    after: list[str] = dataclasses.field(
        default_factory=lambda: ["stage2", "stage4"],
        metadata={
            "help": "evaluate after each of these stages (label 'after_<stage>'): stage1 ... stage4"
        },
    )
    max_tasks: int | None = _field(None, "evaluate on the first N tasks of the eval suite")
    max_turns: int = _field(5, "assistant turns per episode")
    max_new_tokens: int = _field(512, "tokens per assistant turn (the whole answer in single mode)")
    temperature: float = _field(0.0, "0: greedy")
    num_envs: int = _field(
        8,
        "episodes played at once: the environments of agent mode, the prompts of each batch in "
        "single mode (the width of the batch the policy generates for)",
    )
    modes: list[str] = dataclasses.field(
        default_factory=lambda: ["agent"],
        metadata={
            "help": "'agent' (the paper's metric: tools over several turns) and/or 'single' (one "
            "<solution> answer); each mode after the first is written to eval/<label>-<mode>/"
        },
    )
    train_tasks: int = _field(
        0,
        "also evaluate on the first N training tasks of the evaluation's kind (how well the "
        "policy fits what it trained on), into eval/<label>-train/",
    )
    max_context: int = _field(
        32768,
        "tokens of context per episode; an episode that fills it ends there (the vLLM engine's "
        "max_model_len)",
    )
    gpu_memory_utilization: float = _field(
        0.9,
        "the share of the GPU's memory the vLLM engine takes (its weights, then KV cache); it must "
        "be free when the engine starts (see CurriculumConfig.isolate)",
    )

    enforce_eager: bool = _field(
        False,
        "start the vLLM engine without compiling the model (and on a GPU without CUDA graphs): "
        "seconds instead of about a minute to start, 10-20 % slower generation (measured on a CPU)",
    )

    def evaluation(self, mode: str, **fields: Any) -> EvaluationConfig:
        """The settings of one of the curriculum's evaluations in ``mode``; ``fields`` are the
        rest of :class:`EvaluationConfig`'s (its label, suite, prompt setting, dtype, ...)."""
        return EvaluationConfig(
            mode=mode,
            max_turns=self.max_turns,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            num_envs=self.num_envs,
            max_context=self.max_context,
            engine_options=self.engine_options(),
            **fields,
        )

    def engine_options(self) -> dict[str, Any]:
        """The keywords an evaluation's vLLM engine starts with."""
        return {
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_model_len": self.max_context,
            "enforce_eager": self.enforce_eager,
        }

    def __post_init__(self) -> None:
        if isinstance(self.modes, str):
            self.modes = [self.modes]  # `eval.modes=single` on the command line
        if not self.modes or any(m not in ("agent", "single") for m in self.modes):
            raise ValueError(f"eval.modes must list 'agent' and/or 'single', got {self.modes!r}")
        if self.train_tasks < 0:
            raise ValueError(f"eval.train_tasks must be >= 0, got {self.train_tasks}")
        if self.num_envs < 1:
            raise ValueError(f"eval.num_envs must be >= 1, got {self.num_envs}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"eval.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if isinstance(self.after, str):
            self.after = [self.after]  # `eval.after=stage4` on the command line
        if not isinstance(self.after, list):
            raise ValueError(f"eval.after must be a list of stage names, got {self.after!r}")
        unknown = [s for s in self.after if s not in STAGES]
        if unknown:
            raise ValueError(
                f"eval.after: unknown stage {unknown[0]!r}; choose from {', '.join(STAGES)}"
            )

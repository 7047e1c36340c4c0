"""Will a run fit on one GPU? Per stage: the TRL and vLLM settings it resolves to, and its memory.

:func:`plan` resolves a :class:`~birdtrain.config.CurriculumConfig` the way the stages do (the same
``trainer_arguments`` functions, the same dtype rule) for a GPU of ``gpu_gb`` GB, and estimates
each stage's peak memory from the model's shape: weights, gradients, AdamW's moments, the
reference model, activations of one micro-batch, vLLM's share and the KV-cache tokens it leaves.
``birdtrain plan --preset paper-7b --gpu-gb 80`` prints it before anything is downloaded.

The estimate is arithmetic, not a measurement (GB = 10⁹ bytes):

- weights: the model in :attr:`~birdtrain.stages.precision.Precision.weights` (float32 master weights for
  full fine-tuning, plus autocast's half copies during the forward; a LoRA base in the compute
  dtype, plus float32 adapters); gradients and AdamW's two moments in the trainable weights' dtype;
  the reference model (``beta > 0`` without LoRA) in the compute dtype;
- activations per token, with gradient checkpointing: every layer's input (``hidden``) plus the
  tensors one layer saves for its backward while it is recomputed; without it, every layer's.
  What a layer saves was counted on real layers (:data:`SAVED_BYTES`: e.g. ~402 KB a token for a
  Qwen2-7B layer with LoRA r=16 and dropout, ~680 KB a token in all under checkpointing). TRL
  scores completions with a fused LM head, so no ``(tokens × vocabulary)`` logits are held.
  Sequences are taken at their longest;
- vLLM (colocated): ``vllm_gpu_memory_utilization`` of the card, holding its own copy of the
  weights in the compute dtype, a 4,096-token forward (TRL's ``max_num_batched_tokens``), and
  KV cache in the rest. With sleep mode its share is freed while the model trains, so training
  and generation no longer add up. vLLM 0.31 captures its CUDA graphs inside that share (it
  subtracts their profiled size from the KV cache), so the peak holds and the KV-token count is
  an upper bound by the graphs' size.

A stage fits when its peak stays under 90 % of the card (the rest: the CUDA context and
fragmentation), and vLLM's KV cache holds at least one sequence of ``max_model_len``; a
generation batch larger than the KV cache still runs, in several waves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from pathlib import Path
from typing import Any

from birdtrain.config import STAGES, CurriculumConfig, ModelConfig
from birdtrain.models import lora_config, resolve_model
from birdtrain.stages.arguments import checkpointing_keyword
from birdtrain.stages.precision import Precision, dtype_bytes, training_precision

__all__ = [
    "KNOWN_MODELS",
    "SAVED_BYTES",
    "ModelShape",
    "StagePlan",
    "format_plan",
    "model_shape",
    "plan",
]

GB = 1e9
#: Share of the card a plan may fill; the rest is the CUDA context and allocator fragmentation.
HEADROOM = 0.9
#: Tokens of vLLM's profiling forward (TRL starts colocated vLLM with max_num_batched_tokens=4096).
VLLM_PROFILE_TOKENS = 4096

#: Configurations of models the presets name, so a plan needs no download.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-Coder-7B-Instruct": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    # Qwen2.5-Coder-0.5B/1.5B-Instruct as birdtrain.models builds them: the GGUF's own output
    # head, untied from the embedding.
    "qwen-coder-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "qwen-coder-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "smollm": {  # SmolLM2-135M-Instruct
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}


#: Bytes a decoder layer keeps per token for its backward, per unit of each of its dimensions
#: (``hidden``, ``ffn``, ``q_dim``, ``kv_dim``, ``head_dim``, LoRA rank), keyed by (compute dtype's
#: bytes, LoRA, LoRA dropout on). Counted on transformers' Llama and Qwen2 layers (SDPA attention,
#: LoRA on every linear layer) with ``torch.autograd.graph.saved_tensors_hooks``, each storage
#: once; ``tests/test_gpu.py`` counts a layer of another shape against them. Full fine-tuning keeps
#: float32 weights under autocast; dropout keeps a copy of each adapter's input.
SAVED_BYTES: dict[tuple[int, bool, bool], tuple[int, int, int, int, int, int]] = {
    (2, False, False): (26, 8, 4, 4, 8, 0),
    (4, False, False): (24, 16, 8, 8, 8, 0),
    (2, True, False): (18, 8, 6, 4, 4, 14),
    (2, True, True): (38, 12, 10, 4, 4, 14),
    (4, True, False): (16, 16, 8, 8, 8, 28),
    (4, True, True): (48, 20, 16, 8, 8, 28),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What memory depends on: parameter counts and the sizes of one token's tensors."""

    params: int
    #: parameters that train: the LoRA adapters' (LoRA on), else ``params``.
    trainable: int
    hidden: int
    layers: int
    ffn: int
    q_dim: int
    kv_dim: int
    heads: int = 1
    head_dim: int = 0
    #: LoRA rank (0: no LoRA) and whether its dropout is on (it keeps each adapter's input).
    lora_r: int = 0
    lora_dropout: bool = False

    @property
    def lora(self) -> bool:
        """True when only adapters train."""
        return self.trainable != self.params

    def layer_bytes(self, compute_bytes: int) -> int:
        """Bytes one decoder layer keeps per token for its backward (:data:`SAVED_BYTES`)."""
        key = (compute_bytes, self.lora, self.lora and self.lora_dropout)
        hidden, ffn, q, kv, head_dim, rank = SAVED_BYTES[key]
        return (
            hidden * self.hidden
            + ffn * self.ffn
            + q * self.q_dim
            + kv * self.kv_dim
            + head_dim * self.head_dim
            + rank * (self.lora_r if self.lora else 0)
            + 4 * self.heads  # the attention's log-sum-exp, float32
            + 8  # the position id
        )

    def activation_bytes(self, compute_bytes: int, checkpointing: bool) -> int:
        """Activation bytes per token of a training forward and backward: every layer's saved
        tensors, or under checkpointing every layer's input (in the weights' dtype: float32
        for full fine-tuning) and one layer's saved tensors while it is recomputed; plus two
        gradients of the widest activation in flight during the backward."""
        in_flight = 2 * self.ffn * compute_bytes
        if checkpointing:
            stream = compute_bytes if self.lora else 4
            return self.layers * self.hidden * stream + self.layer_bytes(compute_bytes) + in_flight
        return self.layers * self.layer_bytes(compute_bytes) + in_flight

    def kv_bytes(self, compute_bytes: int) -> int:
        """KV-cache bytes per token (keys and values of every layer)."""
        return 2 * self.layers * self.kv_dim * compute_bytes


def _config(name_or_path: str) -> Any:
    """The model's ``transformers`` config, from a folder, the known table or the local hub cache."""
    # the train extra: imported only where used
    from transformers import AutoConfig

    if name_or_path in KNOWN_MODELS:
        values = dict(KNOWN_MODELS[name_or_path])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    path = resolve_model(name_or_path) if name_or_path == "tiny" else name_or_path
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        raise ValueError(
            f"no configuration for model {name_or_path!r} here: give a checkpoint folder, a model "
            f"in the local Hugging Face cache, or one of {', '.join(KNOWN_MODELS)}"
        ) from None


@functools.lru_cache(maxsize=16)
def _shape(name_or_path: str, lora: bool | None, r: int, alpha: int, dropout: float) -> ModelShape:
    # the train extra: imported only where used
    import torch
    from transformers import AutoModelForCausalLM

    config = _config(name_or_path)
    # On the meta device: exact parameter counts, no memory, no weights needed.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        peft_config = lora_config(
            ModelConfig(lora=lora, lora_r=r, lora_alpha=alpha, lora_dropout=dropout), model
        )
        trainable = params
        if peft_config is not None:
            # the train extra: imported only where used
            from peft import get_peft_model

            with warnings.catch_warnings():
                # peft reads an attribute transformers 5 deprecates; nothing a user can act on.
                warnings.simplefilter("ignore", FutureWarning)
                peft_model = get_peft_model(model, peft_config)
            trainable = peft_model.get_nb_trainable_parameters()[0]
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelShape(
        params=params,
        trainable=trainable,
        hidden=text.hidden_size,
        layers=text.num_hidden_layers,
        ffn=text.intermediate_size,
        q_dim=heads * head_dim,
        kv_dim=(getattr(text, "num_key_value_heads", None) or heads) * head_dim,
        heads=heads,
        head_dim=head_dim,
        lora_r=r if peft_config is not None else 0,
        lora_dropout=peft_config is not None and dropout > 0,
    )


def model_shape(model_cfg: ModelConfig) -> ModelShape:
    """The :class:`ModelShape` of a :class:`~birdtrain.config.ModelConfig` (LoRA rule applied)."""
    m = model_cfg
    return _shape(m.name_or_path, m.lora, m.lora_r, m.lora_alpha, m.lora_dropout)


@dataclasses.dataclass
class StagePlan:
    """One stage (or the evaluations): its settings and its memory estimate in GB."""

    stage: str
    #: what the stage hands TRL (``SFTConfig``/``GRPOConfig``) or vLLM (``LLM``), keyword by keyword.
    settings: dict[str, Any]
    memory: dict[str, float]
    peak: float
    gpu_gb: float
    kv_tokens: int | None = None
    kv_tokens_needed: int | None = None
    max_model_len: int | None = None

    @property
    def fits(self) -> bool:
        """Peak under 90 % of the card, and room in vLLM's KV cache for one longest sequence."""
        kv_ok = self.kv_tokens is None or self.kv_tokens >= (self.max_model_len or 0)
        return self.peak <= HEADROOM * self.gpu_gb and kv_ok

    @property
    def waves(self) -> int | None:
        """How many rounds vLLM needs for a generation batch its KV cache cannot hold at once."""
        if not self.kv_tokens or not self.kv_tokens_needed:
            return None
        return math.ceil(self.kv_tokens_needed / self.kv_tokens)


def training_memory(
    shape: ModelShape,
    *,
    weight_bytes: float,
    trainable_bytes: float,
    compute_bytes: int,
    sequences: int,
    seq_len: int,
    tokens: int | None = None,
    checkpointing: bool = True,
    reference: bool = False,
    vllm_gb: float = 0.0,
    sleep: bool = False,
) -> tuple[dict[str, float], float]:
    """``(rows, peak)`` in GB of one training step on one GPU.

    ``weight_bytes``: bytes per parameter the model is held in (a LoRA base's, or the master
    weights'); ``trainable_bytes``: per trainable parameter (its gradient; AdamW keeps two moments
    of the same dtype). ``sequences`` × ``seq_len``: one micro-batch; ``tokens``, where given,
    the tokens it runs instead (a prompt its sequences share runs once). ``vllm_gb``: the colocated
    engine's share; with ``sleep`` it is freed while the model trains.
    """
    lora = shape.lora
    weights = shape.params * weight_bytes + (shape.trainable * trainable_bytes if lora else 0)
    # Autocast casts float32 master weights to the compute dtype and keeps the copies until the
    # backward has used them.
    casts = shape.params * compute_bytes if not lora and weight_bytes > compute_bytes else 0
    rows = {
        "weights": weights / GB,
        "autocast copies": casts / GB,
        "gradients": shape.trainable * trainable_bytes / GB,
        "optimizer": 2 * shape.trainable * trainable_bytes / GB,
        "reference": shape.params * compute_bytes / GB if reference else 0.0,
        "activations": (sequences * seq_len if tokens is None else tokens)
        * shape.activation_bytes(compute_bytes, checkpointing)
        / GB,
        "vllm": vllm_gb,
    }
    resident = rows["weights"] + rows["optimizer"] + rows["reference"]
    training = rows["gradients"] + rows["activations"] + rows["autocast copies"]
    peak = resident + (max(training, vllm_gb) if sleep else training + vllm_gb)
    return rows, peak


def vllm_kv_tokens(shape: ModelShape, share_gb: float, compute_bytes: int) -> int:
    """KV-cache tokens a vLLM engine of ``share_gb`` GB holds beside its weights and profile."""
    engine = shape.params * compute_bytes
    # The profile forward keeps no activations for a backward: one layer's worth of tensors.
    profile = VLLM_PROFILE_TOKENS * shape.layer_bytes(compute_bytes)
    return max(0, int((share_gb * GB - engine - profile) // shape.kv_bytes(compute_bytes)))


def _grpo_plan(
    stage: str,
    s: Any,
    shape: ModelShape,
    precision: Precision,
    settings: dict[str, Any],
    gpu_gb: float,
    *,
    sequences: int,
    seq_len: int,
    tokens: int | None = None,
) -> StagePlan:
    compute = dtype_bytes(precision.compute)
    colocate = settings["use_vllm"] and s.vllm_mode == "colocate"
    share = s.vllm_gpu_memory_utilization * gpu_gb if colocate else 0.0
    rows, peak = training_memory(
        shape,
        weight_bytes=dtype_bytes(precision.weights),
        trainable_bytes=4,
        compute_bytes=compute,
        sequences=settings["per_device_train_batch_size"],
        seq_len=seq_len,
        tokens=tokens,
        checkpointing=settings[checkpointing_keyword()],
        reference=s.beta != 0 and not shape.lora,
        vllm_gb=share,
        sleep=colocate and s.vllm_enable_sleep_mode,
    )
    result = StagePlan(stage, settings, rows, peak, gpu_gb)
    if colocate:
        result.kv_tokens = vllm_kv_tokens(shape, share, compute)
        result.kv_tokens_needed = sequences * seq_len
        result.max_model_len = settings["vllm_max_model_length"]
    return result


def plan(
    cfg: CurriculumConfig, *, gpu_gb: float = 80.0, bf16_supported: bool = True
) -> list[StagePlan]:
    """The :class:`StagePlan` of every enabled stage of ``cfg``, then of its evaluations (vLLM).

    The settings are those each stage would pass on a GPU of ``gpu_gb`` GB (bfloat16-capable
    unless ``bf16_supported=False``).
    """
    # Only the GPU plan needs the stages' trainer arguments; `birdtrain plan`'s other paths stay
    # light (the stages bring gymnasium: 0.76 s of CPU measured for agentic alone).
    from birdtrain.stages import agentic, grpo, sft

    shape = model_shape(cfg.model)
    precision = training_precision(
        cfg.model.dtype, lora=shape.lora, cuda=True, bf16_supported=bf16_supported
    )
    weight_bytes, compute = dtype_bytes(precision.weights), dtype_bytes(precision.compute)
    plans = []
    for stage in STAGES:
        s = getattr(cfg, stage)
        if not s.enabled:
            continue
        out_dir = Path(cfg.run_dir) / stage
        if stage in ("stage1", "stage2"):
            settings = sft.trainer_arguments(cfg, out_dir, precision, int(stage[-1]))
            rows, peak = training_memory(
                shape,
                weight_bytes=weight_bytes,
                trainable_bytes=4,
                compute_bytes=compute,
                sequences=s.per_device_batch_size,
                seq_len=s.max_length,
                checkpointing=settings[checkpointing_keyword()],
            )
            plans.append(StagePlan(stage, settings, rows, peak, gpu_gb))
        else:
            tokens = None
            if stage == "stage3":
                settings = grpo.trainer_arguments(cfg, out_dir, precision)
                sequences = s.prompts_per_step * s.num_generations
                seq_len = s.max_prompt_length + s.max_completion_length
                micro = settings["per_device_train_batch_size"]
                if s.share_prompt and not settings[checkpointing_keyword()]:
                    # Each distinct prompt of a micro-batch runs once (stages.shared_prompt).
                    tokens = (
                        min(micro, s.prompts_per_step) * s.max_prompt_length
                        + micro * s.max_completion_length
                    )
            else:
                # Stage 4's shared first prompt has no bound of its own below max_context.
                settings = agentic.trainer_arguments(cfg, out_dir, precision)
                sequences, seq_len = s.tasks_per_step * s.num_generations, s.max_context
            plans.append(
                _grpo_plan(
                    stage,
                    s,
                    shape,
                    precision,
                    settings,
                    gpu_gb,
                    sequences=sequences,
                    seq_len=seq_len,
                    tokens=tokens,
                )
            )
    if cfg.eval.enabled:
        # An evaluation's own process: its vLLM engine alone on the card.
        settings = cfg.eval.engine_options()
        share = settings["gpu_memory_utilization"] * gpu_gb
        result = StagePlan("eval", settings, {"vllm": share}, share, gpu_gb)
        result.kv_tokens = vllm_kv_tokens(shape, share, compute)
        result.max_model_len = settings["max_model_len"]
        plans.append(result)
    return plans


_COLUMNS = (
    ("weights", "weights"),
    ("autocast copies", "casts"),
    ("gradients", "grads"),
    ("optimizer", "adam"),
    ("reference", "ref"),
    ("activations", "activ."),
    ("vllm", "vLLM"),
)


def format_plan(cfg: CurriculumConfig, plans: list[StagePlan]) -> str:
    """The table ``birdtrain plan`` prints: memory per stage in GB, then each stage's settings."""
    shape = model_shape(cfg.model)
    gpu = plans[0].gpu_gb if plans else 0.0
    trained = (
        f"LoRA r={cfg.model.lora_r}: {shape.trainable / 1e6:.1f} M trainable"
        if shape.lora
        else "full fine-tuning"
    )
    lines = [
        f"{cfg.name}: {cfg.model.name_or_path}, {shape.params / 1e9:.2f} B parameters, {trained}; "
        f"one {gpu:g} GB GPU (estimates in GB, peak must stay under {HEADROOM:.0%})",
        "",
        f"{'stage':<8}"
        + "".join(f"{title:>9}" for _, title in _COLUMNS)
        + f"{'peak':>9}  {'fits':<5} KV-cache tokens",
    ]
    for p in plans:
        cells = "".join(
            f"{p.memory[key]:>9.1f}" if p.memory.get(key) else f"{'-':>9}" for key, _ in _COLUMNS
        )
        kv = "-"
        if p.kv_tokens is not None:
            kv = f"{p.kv_tokens:,}"
            if p.kv_tokens_needed:
                kv += f" (step needs {p.kv_tokens_needed:,}: {p.waves} wave{'s' * (p.waves != 1)})"
            if p.max_model_len and p.kv_tokens < p.max_model_len:
                kv += f" < max_model_len {p.max_model_len:,}"
        lines.append(f"{p.stage:<8}{cells}{p.peak:>9.1f}  {'yes' if p.fits else 'NO':<5} {kv}")
    lines.append("")
    for p in plans:
        what = "vllm.LLM" if p.stage == "eval" else "TRL"
        settings = ", ".join(f"{k}={v!r}" for k, v in p.settings.items() if k != "output_dir")
        lines.append(f"{p.stage} ({what}): {settings}")
    return "\n".join(lines)

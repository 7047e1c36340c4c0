"""Generation policies: what produces an agent's turns during rollouts and evaluation.

- Token-level policies (:class:`Policy`) for :func:`birdtrain.rollout.collect`:
  :class:`TransformersPolicy` (a ``transformers`` causal LM), :class:`VLLMPolicy` (a
  ``GRPOTrainer``'s vLLM engine) and :class:`VLLMEnginePolicy` (a standalone ``vllm.LLM``);
  :func:`generation_policy` picks one for a checkpoint.
- :class:`EndpointPolicy`: a model behind an OpenAI-compatible chat endpoint, which acts on the
  environment's conversation instead of token ids (the server owns its tokenizer).
"""

from __future__ import annotations

from typing import Any, Protocol

from birdenv.errors import MissingExtraError
from birdenv.tools import TOOL_SCHEMAS

__all__ = [
    "SAMPLING",
    "EndpointPolicy",
    "Policy",
    "TransformersPolicy",
    "VLLMEnginePolicy",
    "VLLMPolicy",
    "backbone",
    "eos_token_ids",
    "generation_policy",
    "kv_cache_keyword",
    "unwrapped",
]


#: The sampling rule of every engine (transformers, TRL's vLLM, a standalone vLLM): the
#: temperature alone shapes the distribution, and nothing comes from a checkpoint's
#: generation_config (its top-k, top-p, min-p or repetition penalty), so the logprobs are those of
#: the distribution the tokens were drawn from, whichever engine drew them.
SAMPLING = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


class Policy(Protocol):
    """What :func:`collect` needs from a policy: a tokenizer and batched generation on token ids.

    A policy may also name every id that ends a turn in ``eos_ids`` (:func:`eos_token_ids`; the
    policies here do); without it, the tokenizer's EOS alone ends one.
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
    import inspect

    parameters = inspect.signature(unwrapped(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class TransformersPolicy:
    """Batched sampling with a ``transformers`` causal LM (left padding), with sampling logprobs.

    Sampling follows :data:`SAMPLING`: the plain softmax at ``temperature``, nothing from the
    model's own generation config; ``temperature=0`` is greedy (what ``generate`` does with those
    settings). Every id of :func:`eos_token_ids` ends a turn. The decoding loop is this class's
    own rather than ``generate``'s so that a row leaves the batch when its turn ends: a batch
    costs what its rows generate, not its longest row times its size (turns of one batch range
    from ~60 to the budget's 512 tokens), and a context the batch repeats is read once.
    """

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = eos_token_ids(tokenizer, getattr(model, "generation_config", None))

    def generate(
        self, batch: list[list[int]], *, max_new_tokens: int, temperature: float
    ) -> list[tuple[list[int], list[float]]]:
        """Sample one turn for every context in ``batch``."""
        import torch

        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        width = max(len(ids) for ids in batch)
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch], device=device)
        attention = torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device
        )
        eos = torch.tensor(sorted(self.eos_ids), device=device)
        results: list[tuple[list[int], list[float]]] = [([], []) for _ in batch]
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling
        try:
            with torch.no_grad():
                cache = self._prefill(batch, input_ids, attention)
                keyword = kv_cache_keyword(self.model)
                rows = torch.arange(len(batch), device=device)  # the rows still generating
                step_ids = input_ids[:, -1:]  # each context's last token comes first
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
                    if step == max_new_tokens - 1 or not going.any():
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
        return results

    def _prefill(self, batch: list[list[int]], input_ids: Any, attention: Any) -> Any:
        """The KV cache (a ``DynamicCache``) of every context but its last token: each distinct
        context runs once (a GRPO group samples one prompt several times) and its keys and
        values are repeated for every row that holds it.

        Positions are counted from each row's first real token (left padding), as the decoding
        steps count them.
        """
        import torch
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if input_ids.size(1) < 2:
            return cache
        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(tuple(ids), len(distinct)) for ids in batch]
        firsts = torch.tensor(
            [rows.index(i) for i in range(len(distinct))], device=input_ids.device
        )
        ids, mask = input_ids[firsts, :-1], attention[firsts, :-1]
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        # Through the decoder alone: no logits are needed over the contexts.
        decoder = backbone(self.model)
        decoder(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{kv_cache_keyword(decoder): cache},
        )
        if len(distinct) < len(batch):
            cache.batch_select_indices(torch.tensor(rows, device=input_ids.device))
        return cache


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
        from transformers import GenerationConfig
        from vllm import LLM

        self.tokenizer = tokenizer
        try:
            declared = GenerationConfig.from_pretrained(model_path)
        except OSError:  # a checkpoint without generation_config.json
            declared = None
        self.eos_ids = eos_token_ids(tokenizer, declared)
        self.llm = LLM(
            model=model_path, tokenizer=model_path, generation_config="vllm", **engine_kwargs
        )

    def generate(
        self, batch: list[list[int]], *, max_new_tokens: int, temperature: float
    ) -> list[tuple[list[int], list[float]]]:
        """Sample one turn for every context in ``batch`` with vLLM."""
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


def generation_policy(
    model_path: str, *, engine: str = "auto", engine_options: dict[str, Any] | None = None
) -> Any:
    """The policy that generates for evaluation from a checkpoint: ``engine="vllm"``,
    ``"transformers"`` (on CUDA when present), or ``"auto"`` (vLLM when it is installed and CUDA
    is present). ``engine_options`` go to the vLLM engine (see :class:`VLLMEnginePolicy`)."""
    import importlib.util

    import torch

    from birdtrain.models import inference_device, load_policy, load_tokenizer, resolve_model

    if engine not in ("auto", "vllm", "transformers"):
        raise ValueError(f"engine must be auto, vllm or transformers, got {engine!r}")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if engine == "auto":
        engine = "vllm" if has_vllm and torch.cuda.is_available() else "transformers"
    if engine == "transformers":
        return TransformersPolicy(*load_policy(model_path, device=inference_device()))
    if not has_vllm:
        raise MissingExtraError("vllm", "vllm")
    path = resolve_model(model_path)
    return VLLMEnginePolicy(path, load_tokenizer(path), **(engine_options or {}))


class EndpointPolicy:
    """A model behind an OpenAI-compatible ``/v1/chat/completions`` endpoint, as an agent.

    ``name`` is the endpoint's model name: evaluations are labelled with it. Built from the spec
    ``endpoint:MODEL@URL`` with :meth:`from_spec`.

    >>> EndpointPolicy.from_spec("endpoint:qwen@http://127.0.0.1:8000").name
    'qwen'
    """

    PREFIX = "endpoint:"

    def __init__(self, url: str, model: str, *, api_key: str | None = None) -> None:
        from birdtrain.data.teacher import Teacher

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

"""Policies that load offline: a tiny random model built on the fly (tests, smoke runs).

Nothing here downloads anything: the tiny model's tokenizer is trained on the spot with
``tokenizers`` and carries TRL's own Qwen3 chat template, so TRL recognises it and can train with
tool calls and assistant-only loss.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SPECIAL_TOKENS", "build_tiny_model"]

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

# Text the byte-level BPE learns its merges from: SQL, tool-call JSON and chat words.
_CORPUS = [
    "SELECT name, COUNT(*) FROM orders WHERE total IS NULL GROUP BY name ORDER BY 2 DESC LIMIT 10;",
    "UPDATE accounts SET balance = balance - 10 WHERE id = 1; INSERT INTO t VALUES (1, 'a');",
    '{"name": "execute_sql", "arguments": {"sql": "SELECT 1"}}',
    '{"name": "submit_solution", "arguments": {"sql_list": ["SELECT 1"]}}',
    "user assistant system tool The query returns the wrong rows because the join drops NULLs.",
    "status: ok rows: columns error: no such table verdict: success failed",
]


def build_tiny_model(path: str | Path, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """Build and save a tiny random Qwen3 causal LM with a real tokenizer at ``path``.

    Hidden size 64, two layers, ~0.5 MB: enough for TRL to run SFT and GRPO end to end in seconds.
    """
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
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = qwen3_chat_template
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path

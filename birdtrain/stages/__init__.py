"""The curriculum's stages, one module each, all with the same contract.

``run(cfg, *, model_path, out_dir, **inputs) -> Path`` trains from ``model_path``, writes
``out_dir/metrics.jsonl`` (one JSON object per logging step), saves a full checkpoint (LoRA merged)
with its tokenizer to ``out_dir/"checkpoint"`` and returns that path.

- :mod:`birdtrain.stages.sft`: stage 1 (reasoning imitation) and stage 2 (tool-use imitation).
- :mod:`birdtrain.stages.grpo`: stage 3 (single-turn GRPO rewarded by the judge).
- :mod:`birdtrain.stages.agentic`: stage 4 (multi-turn GRPO in the environment).
- :mod:`birdtrain.stages.common`: what the stages share (precision, arguments, checkpoints).
"""

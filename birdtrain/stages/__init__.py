"""The curriculum's stages, one module each, all with the same contract.

``run(cfg, *, model_path, out_dir, **inputs) -> Path`` trains from ``model_path``, writes
``out_dir/metrics.jsonl`` (one JSON object per logging step), saves a full checkpoint (LoRA merged)
with its tokenizer to ``out_dir/"checkpoint"`` and returns that path.

- :mod:`birdtrain.stages.sft`: stage 1 (reasoning imitation) and stage 2 (tool-use imitation).
- :mod:`birdtrain.stages.grpo`: stage 3 (single-turn GRPO rewarded by the judge).
- :mod:`birdtrain.stages.agentic`: stage 4 (multi-turn GRPO in the environment).
- what they share, one job a module: :mod:`~birdtrain.stages.precision` (the dtype rule),
  :mod:`~birdtrain.stages.loading` (the model on one GPU), :mod:`~birdtrain.stages.arguments`
  (trainer keywords), :mod:`~birdtrain.stages.training` (driving the trainer) and
  :mod:`~birdtrain.stages.outputs` (metrics and the merged checkpoint).
"""

"""Pure maths: tensors and numbers in, tensors and numbers out; no model, module or trainer.

Losses and their aggregation, advantage estimators, rollout-correction weights, outcome
signals (pass rates, informative groups), NPO's signals, algorithm presets, pass@k.
May import: ``rlvr_lightning.types`` and each other (no circles).
"""

"""What ``predict`` writes: one JSON record per prompt with its completions, rewards and pass@k."""

from __future__ import annotations

import math
from typing import Any

from rlvr_lightning.algorithms.metrics import pass_at_k
from rlvr_lightning.types import PromptBatch, Scored


def _number(value: float) -> float | None:
    """A reward as JSON can hold it: NaN (the function did not apply) becomes None."""
    return None if math.isnan(value) else value


def prediction_records(batch: PromptBatch, scored: Scored) -> list[dict[str, Any]]:
    """``[B]`` records: prompt, answer, the ``G`` completions (text, total reward, each
    function's reward, correct) and the prompt's ``pass@1`` and ``pass@G`` (unbiased)."""
    g = scored.rollouts.group_size
    texts = scored.rollouts.completions
    correct = scored.correct.tolist()  # [N]
    totals = scored.rewards.tolist()  # [N]
    per_function = {name: values.tolist() for name, values in scored.per_function.items()}
    records = []
    for i, prompt_id in enumerate(batch.prompt_ids):
        rows = range(i * g, (i + 1) * g)
        solved = sum(bool(correct[r]) for r in rows)
        records.append(
            {
                "prompt_id": prompt_id,
                "prompt": batch.messages[i][-1]["content"],
                "answer": batch.columns.get("answer", [None] * len(batch))[i],
                "completions": [
                    {
                        "text": texts[r],
                        "reward": _number(totals[r]),
                        "rewards": {n: _number(v[r]) for n, v in per_function.items()},
                        "correct": bool(correct[r]),
                    }
                    for r in rows
                ],
                "pass@1": pass_at_k(g, solved, 1),
                f"pass@{g}": pass_at_k(g, solved, g),
            }
        )
    return records

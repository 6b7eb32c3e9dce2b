"""Format and length rewards: a boxed answer is present, overlong completions are penalised."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlvr_lightning.rewards.math import BOX_OPEN, extract_boxed
from rlvr_lightning.rewards.trl_contract import Completion, completion_text


def boxed_format(completions: list[Completion], **_: object) -> list[float | None]:
    r"""1.0 when the completion's last ``\boxed{}`` is non-empty and holds no box, else 0.0.

    Any content pays, so early boxes that restate the question or copy the instruction's
    example (``\boxed{4 + 4}``, ``\boxed{Paris}``) are stepping stones to boxing the answer; a
    box nested in another does not: rewarded, nested boxes became what the policy wrote
    (``\boxed{4 \times \boxed{4}}``, issue 40). Paying only a boxed number was tried and
    taught the policy to box a bare guess and stop working the sum out (README, "Measured
    quickstart results"). This rule is this project's choice.

    >>> boxed_format([r"\boxed{3}", r"\boxed{ }", "3", r"\boxed{2+1}", r"\boxed{1 \boxed{3}}"])
    [1.0, 0.0, 0.0, 1.0, 0.0]
    """
    boxes = (extract_boxed(completion_text(c)) or "" for c in completions)
    return [float(bool(box.strip()) and not BOX_OPEN.search(box)) for box in boxes]


def _check_overlong_args(max_len: int, buffer_len: int, factor: float) -> None:
    if not 0 < buffer_len <= max_len:
        raise ValueError(
            f"overlong penalty needs 0 < buffer_len <= max_len; got buffer_len={buffer_len}, "
            f"max_len={max_len}. Set buffer_len to the soft zone before the limit (DAPO: 4096 "
            f"of 20480)."
        )
    if factor < 0:
        raise ValueError(
            f"overlong penalty factor must be >= 0 (it scales a penalty); got {factor}."
        )


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476, §3.4), scaled by ``factor``.

    With ``L = max_len`` and ``C = buffer_len``::

        0                          if len <= L - C
        factor * ((L - C) - len) / C    if L - C < len <= L
        -factor                    if len > L

    verl's code (``min(-(len - (L - C)) / C * factor, 0)``) keeps falling linearly past ``L``;
    we clamp at ``-factor`` as the paper does, so a row far past the limit (possible when the
    budget given to the engine exceeds ``max_len``) cannot outweigh the accuracy reward.

    Hand check (``L = 10``, ``C = 4``): lengths 6, 8, 10, 13 give 0, -0.5, -1, -1.

    >>> overlong_penalty(torch.tensor([6, 8, 10, 13]), max_len=10, buffer_len=4)
    tensor([ 0.0000, -0.5000, -1.0000, -1.0000])
    """
    _check_overlong_args(max_len, buffer_len, factor)
    dtype = lengths.dtype if lengths.is_floating_point() else torch.float32
    excess = (lengths.to(dtype) - (max_len - buffer_len)) / buffer_len  # [N]
    # Adding 0.0 turns the -0.0 of rows at the threshold into 0.0 for clean logs and doctests.
    return (-excess * factor).clamp(min=-factor, max=0.0) + 0.0


class OverlongPenalty:
    """Reward object applying :func:`overlong_penalty` to the ``completion_length`` column.

    Args:
        max_len: maximum completion length ``L_max`` in tokens.
        buffer_len: length of the soft zone ``L_cache`` before ``max_len``.
        factor: penalty at and beyond ``max_len`` (the paper uses 1.0).

    >>> OverlongPenalty(max_len=10, buffer_len=4)(["a", "b"], completion_length=[6, 8])
    [0.0, -0.5]
    """

    name = "overlong_penalty"

    def __init__(self, max_len: int, buffer_len: int, factor: float = 1.0) -> None:
        _check_overlong_args(max_len, buffer_len, factor)
        self.max_len = max_len
        self.buffer_len = buffer_len
        self.factor = factor

    def __call__(
        self, completions: list[str], completion_length: Sequence[float], **_: object
    ) -> list[float | None]:
        lengths = torch.tensor([float(n) for n in completion_length])  # [N]
        penalty = overlong_penalty(lengths, self.max_len, self.buffer_len, self.factor)  # [N]
        return [float(p) for p in penalty]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_len={self.max_len}, buffer_len={self.buffer_len}, "
            f"factor={self.factor})"
        )

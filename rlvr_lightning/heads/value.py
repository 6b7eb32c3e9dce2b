"""``ValueHead``: a critic on the policy's final hidden state, for PPO with GAE (spec §8.7).

The head shares the policy's trunk instead of a separate critic LM: its input is what the LM
head sees (``forward.lm_head_inputs``), so the update's forward gives the values ``V_θ`` with
the log-probs, and ``V_old`` costs one no-grad forward before the update (fused with the
``π_old`` forward when the module recomputes it, see ``optimise.UpdateStage``). The head's
settings (clipping, GAE's ``γ``/``λ``, learning rate) are its constructor arguments, so one
YAML block configures the critic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlvr_lightning.algorithms.advantages import gae
from rlvr_lightning.types import Rollouts, Scored


class ValueHead(nn.Module):
    """Per-token value ``V(s_t)`` from the policy's last hidden state, and the critic's settings.

    Args:
        hidden_size: width of the policy's last hidden state; ``RLVRModule`` supplies it, so a
            config names only the others (``value_head: {class_path:
            rlvr_lightning.heads.ValueHead, init_args: {lr: ...}}``).
        mlp_hidden: 0 for a linear head ``H -> 1`` (default); ``k > 0`` for a small MLP
            ``H -> k -> GELU -> 1``.
        lr: learning rate of the head's own optimiser parameter group.
        weight_decay: AdamW weight decay of that group.
        clip_range: value clipping ``ε_v`` of ``losses.value_loss`` (verl: 0.5); None: off.
        loss_coef: weight of the value loss in the step's objective.
        gamma: GAE discount ``γ`` (verl: 1.0).
        lam: GAE ``λ`` (verl: 1.0).
        whiten: whiten the advantages over the batch's valid tokens (verl does).
        train_trunk: let the value loss's gradient reach the policy (a shared actor-critic).
            False (default): the head trains on detached hidden states, so the critic never
            changes the policy, as with verl's separate critic model.
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        mlp_hidden: int = 0,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        clip_range: float | None = 0.5,
        loss_coef: float = 1.0,
        gamma: float = 1.0,
        lam: float = 1.0,
        whiten: bool = True,
        train_trunk: bool = False,
    ) -> None:
        super().__init__()
        if mlp_hidden < 0 or not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
            raise ValueError(
                f"ValueHead needs mlp_hidden >= 0 and gamma, lam in [0, 1]; got "
                f"mlp_hidden={mlp_hidden}, gamma={gamma}, lam={lam}."
            )
        if clip_range is not None and clip_range <= 0:
            raise ValueError(f"ValueHead clip_range must be > 0 or null, got {clip_range}.")
        self.lr, self.weight_decay = lr, weight_decay
        self.clip_range, self.loss_coef = clip_range, loss_coef
        self.gamma, self.lam, self.whiten = gamma, lam, whiten
        self.train_trunk = train_trunk
        out = nn.Linear(mlp_hidden or hidden_size, 1)
        # Zero output: V starts at 0, so the first advantages are the whitened rewards.
        nn.init.zeros_(out.weight)
        nn.init.zeros_(out.bias)
        layers = [nn.Linear(hidden_size, mlp_hidden), nn.GELU(), out] if mlp_hidden else [out]
        self.net = nn.Sequential(*layers)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` hidden states (any float dtype) -> ``[...]`` fp32 values."""
        if not self.train_trunk:
            hidden = hidden.detach()
        weight = self.net[0].weight
        return self.net(hidden.to(weight.dtype)).squeeze(-1).float()

    def param_group(self) -> dict[str, Any]:
        """The head's optimiser parameter group (its own learning rate and weight decay)."""
        return {"params": list(self.parameters()), "lr": self.lr, "weight_decay": self.weight_decay}

    def estimator_kwargs(
        self, rollouts: Rollouts, trained_rows: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """Keyword arguments of ``advantages.compute_advantages`` for the ``gae`` estimator;
        ``trained_rows`` (``[N]`` bool) are the rows whose tokens set the whitening
        statistics (the groups the update uses; None: all)."""
        return {
            "values": _old_values(rollouts),
            "mask": rollouts.completion_mask,
            "gamma": self.gamma,
            "lam": self.lam,
            "whiten": self.whiten,
            "whiten_rows": trained_rows,
        }

    def targets(self, scored: Scored) -> ValueBatch:
        """``V_old`` and the returns ``R = Â + V_old`` (before whitening) of the value loss."""
        old = _old_values(scored.rollouts)  # [N, T]
        _, returns = gae(scored.rewards, old, scored.rollouts.completion_mask, self.gamma, self.lam)
        return ValueBatch(head=self, old_values=old, returns=returns)


@dataclass(frozen=True)
class ValueBatch:
    """What the value loss of one rollout batch needs: the head, ``V_old`` and ``R``."""

    head: ValueHead
    old_values: torch.Tensor  # [N, T] values at rollout time (0 on padding)
    returns: torch.Tensor  # [N, T] GAE returns (0 on padding)


def _old_values(rollouts: Rollouts) -> torch.Tensor:
    if rollouts.old_values is None:
        raise RuntimeError(
            "The rollouts carry no values: RLVRModule.recompute_old_logprobs fills "
            "Rollouts.old_values before advantages are computed; call it first."
        )
    return rollouts.old_values

"""``ProbeHead``: POISE's value estimate from the policy's own hidden states (spec §7.1).

Each rollout's features ``z_i`` are the mean hidden state at ``layer`` over the last
``last_tokens`` prompt tokens and over the states predicting the last ``last_tokens``
response tokens, plus the response's mean token entropy, all from the no-grad trainer pass
that also gives ``π_old`` (``device.trainer_forward``; one pass of its own otherwise).
A ridge regression on their PCA (``heads.probe.RidgeProbe``) predicts the *siblings'* mean
reward; the baseline of row ``i`` is the mean of its siblings' predictions, so it never sees
row ``i``'s state and the advantage ``r_i - b_i`` stays unbiased.

The FIFO row buffer, the counters and the fitted probe are buffers: a checkpoint holds them
(``torch.load(weights_only=True)`` reads it) and a resume continues exactly. Exports write
the fitted probe alone (``probe_head.safetensors`` + ``probe_head.json``), which
:meth:`ProbeHead.from_pretrained` loads on its own to rerank samples at test time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from rlvr_lightning.algorithms.advantages import sibling_mean
from rlvr_lightning.device import DEFAULT_CHUNK_TOKENS, trainer_forward
from rlvr_lightning.heads.probe import RidgeProbe, fit_quality, rows_to_drop
from rlvr_lightning.types import Rollouts, Scored

_CONFIG_KEYS = (
    "hidden_size", "layer", "last_tokens", "prompt_pca", "response_pca", "alpha", "reward_range",
)  # fmt: skip


class ProbeHead(nn.Module):
    """POISE's probe and its training schedule (``estimator: probe``).

    One probe for all prompts: POISE keeps one per domain (math, code, other); a single
    domain is this project's choice. Of POISE's three entropy scalars only the whole
    response's mean is used (the reasoning/answer split needs a ``<think>`` format).

    Args:
        hidden_size: width of the hooked layer; ``RLVRModule`` supplies it (the LM head's
            input width), so a config names only the others.
        layer: hidden-state layer, numbered as transformers' ``output_hidden_states``
            (0: embeddings, ``i``: block ``i``'s output); -1 (default): the final norm's
            output, the LM head's input. POISE used layer 19 of Qwen3-4B's 36.
        last_tokens: prompt / response tokens averaged (POISE: 10).
        prompt_pca: PCA components of the prompt feature (POISE: 32), at most ``hidden_size``.
        response_pca: PCA components of the response feature (POISE: 64), at most
            ``hidden_size``. Fewer buffered rows than components leave the rest 0.
        alpha: ridge penalty (POISE: 100).
        reward_range: predictions are clipped to it (POISE: ``[0, 1]``, its reward being
            correctness). None (default): to the range of the buffered targets at each fit,
            so a weighted total reward (the default rewards' 0-2) is never clipped to a
            range it does not have; this project's choice.
        bootstrap_steps: steps with RLOO advantages (the siblings' rewards as the baseline)
            while the probe collects rows; the probe's baseline is used from then on once it
            is fitted. POISE: 16 steps of 256 prompts; 4 is this project's default, sized for
            small models and short runs.
        warmup_steps: observed steps before the first fit (POISE: 8); this project: 2.
        refit_every: refit on the whole buffer every this many steps after ``warmup_steps``
            (POISE: every step).
        buffer_rows: FIFO capacity in rows; whole groups are evicted, oldest first (POISE,
            math domain: 4096).
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        layer: int = -1,
        last_tokens: int = 10,
        prompt_pca: int = 32,
        response_pca: int = 64,
        alpha: float = 100.0,
        reward_range: tuple[float, float] | None = None,
        bootstrap_steps: int = 4,
        warmup_steps: int = 2,
        refit_every: int = 1,
        buffer_rows: int = 4096,
    ) -> None:
        super().__init__()
        if min(last_tokens, prompt_pca, response_pca, warmup_steps, refit_every) < 1:
            raise ValueError(
                "ProbeHead needs last_tokens, prompt_pca, response_pca, warmup_steps and "
                "refit_every >= 1."
            )
        if bootstrap_steps < 0 or buffer_rows < 2 or alpha < 0:
            raise ValueError(
                f"ProbeHead needs bootstrap_steps >= 0, buffer_rows >= 2 and alpha >= 0; got "
                f"{bootstrap_steps}, {buffer_rows}, {alpha}."
            )
        self.hidden_size, self.layer, self.last_tokens = hidden_size, layer, last_tokens
        self.prompt_pca, self.response_pca = (
            min(prompt_pca, hidden_size),
            min(response_pca, hidden_size),
        )
        self.alpha = alpha
        self.reward_range = None if reward_range is None else tuple(map(float, reward_range))
        low, high = self.reward_range or (None, None)
        self.bootstrap_steps, self.warmup_steps = bootstrap_steps, warmup_steps
        self.refit_every = refit_every
        self.probe = RidgeProbe(
            hidden_size,
            hidden_size,
            1,
            prompt_pca=self.prompt_pca,
            response_pca=self.response_pca,
            alpha=alpha,
            low=low,
            high=high,
        )
        self.register_buffer("buffer_features", torch.zeros(buffer_rows, self.num_features))
        self.register_buffer("buffer_targets", torch.zeros(buffer_rows))
        self.register_buffer("buffer_groups", torch.zeros(buffer_rows, dtype=torch.long))
        self.register_buffer("buffer_count", torch.zeros((), dtype=torch.long))
        self.register_buffer("steps_observed", torch.zeros((), dtype=torch.long))
        self.register_buffer("groups_seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("fit_r2", torch.zeros(()))
        self.register_buffer("fit_corr", torch.zeros(()))

    @property
    def num_features(self) -> int:
        """``F``: prompt mean ``[H]``, response mean ``[H]``, mean token entropy ``[1]``."""
        return 2 * self.hidden_size + 1

    @property
    def fitted(self) -> bool:
        return bool(self.probe.fitted)

    @property
    def active(self) -> bool:
        """Whether the probe's baseline replaces RLOO's (bootstrap over and fitted)."""
        return self.fitted and int(self.steps_observed) >= self.bootstrap_steps

    # ---- features and predictions ----------------------------------------------------------

    def row_features(
        self, prompt_mean: torch.Tensor, response_mean: torch.Tensor, entropy: torch.Tensor
    ) -> torch.Tensor:
        """``[n, F]`` fp32 inputs from ``[n, H]``, ``[n, H]`` and ``[n]``."""
        return torch.cat([prompt_mean.float(), response_mean.float(), entropy.float()[:, None]], -1)

    def _split(self, features: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.hidden_size
        return features[:, :h], features[:, h : 2 * h], features[:, 2 * h :]

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """``[n]`` predicted expected reward of each row's prompt, clipped to
        ``reward_range`` (None: the last fit's targets' range)."""
        return self.probe(*self._split(features.to(self.buffer_features)))

    def score_rollouts(
        self,
        model: nn.Module,
        rollouts: Rollouts,
        micro_batch_size: int = 8,
        head_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    ) -> torch.Tensor:
        """``[N]`` predictions for rollouts of ``model`` (one no-grad forward): rerank samples
        at test time, or compare with a prompt's pass rate."""
        features = trainer_forward(
            model, rollouts, micro_batch_size, head_chunk_tokens=head_chunk_tokens, probe=self
        ).probe_features  # [N, F]
        return self.predict(features)

    def estimator_kwargs(self, scored: Scored) -> dict[str, Any]:
        """Keyword arguments of ``advantages.compute_advantages`` for the ``probe`` estimator:
        the probe's predictions once :attr:`active`; before, the rewards themselves, so the
        siblings' mean reward is the baseline, which is RLOO exactly."""
        if not self.active:
            return {"predictions": scored.rewards.float()}
        return {"predictions": self.predict(_features(scored.rollouts))}

    # ---- the buffer and the fit -----------------------------------------------------------

    @torch.no_grad()
    def observe(self, scored: Scored) -> dict[str, float]:
        """Add the step's rows (targets: the siblings' mean reward) to the buffer, refit when
        due, and return the step's ``probe/*`` metrics. Call after the advantages are fixed."""
        g = scored.rollouts.group_size
        features = _features(scored.rollouts).to(self.buffer_features)  # [N, F]
        targets = sibling_mean(scored.rewards, g).to(self.buffer_targets)  # [N]
        groups = self.groups_seen + torch.arange(len(targets), device=targets.device) // g  # [N]
        self._append(features, targets, groups)
        self.groups_seen += len(targets) // g
        self.steps_observed += 1
        since = int(self.steps_observed) - self.warmup_steps
        refit = since >= 0 and since % self.refit_every == 0
        if refit:
            self.refit()
        metrics = {
            "probe/fitted": float(self.fitted),
            "probe/active": float(self.active),
            "probe/buffer_rows": float(self.buffer_count),
            "probe/refit": float(refit),
        }
        if self.fitted:
            metrics.update(
                {"probe/fit_r2": float(self.fit_r2), "probe/fit_corr": float(self.fit_corr)}
            )
        return metrics

    def _append(self, features: torch.Tensor, targets: torch.Tensor, groups: torch.Tensor) -> None:
        count, capacity = int(self.buffer_count), len(self.buffer_targets)
        all_f = torch.cat([self.buffer_features[:count], features])  # [M, F]
        all_t = torch.cat([self.buffer_targets[:count], targets])  # [M]
        all_g = torch.cat([self.buffer_groups[:count], groups])  # [M]
        drop = rows_to_drop(all_g, len(all_t) - capacity)
        kept = len(all_t) - drop
        self.buffer_features[:kept] = all_f[drop:]
        self.buffer_targets[:kept] = all_t[drop:]
        self.buffer_groups[:kept] = all_g[drop:]
        self.buffer_count.fill_(kept)

    @torch.no_grad()
    def refit(self) -> None:
        """Fit PCA and ridge on the whole buffer; record the in-buffer R² and correlation."""
        count = int(self.buffer_count)
        if count < 2:
            return
        features, targets = self.buffer_features[:count], self.buffer_targets[:count]
        self.probe.fit(*self._split(features), targets)
        r2, corr = fit_quality(self.predict(features), targets)
        self.fit_r2.fill_(r2)
        self.fit_corr.fill_(corr)

    # ---- export ---------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The constructor arguments a loaded probe needs to predict."""
        return {key: getattr(self, key) for key in _CONFIG_KEYS}

    def save_pretrained(self, dirpath: str | Path, name: str = "probe_head") -> list[Path]:
        """Write the fitted probe (not the row buffer) as ``<name>.safetensors`` and its
        settings as ``<name>.json``; returns the two paths."""
        path = Path(dirpath)
        tensors = {
            k: v.detach().cpu().contiguous().clone() for k, v in self.probe.state_dict().items()
        }
        weights, config = path / f"{name}.safetensors", path / f"{name}.json"
        save_file(tensors, str(weights), metadata={"class": type(self).__qualname__})
        config.write_text(json.dumps(self.config(), indent=2, sort_keys=True) + "\n")
        return [weights, config]

    @classmethod
    def from_pretrained(cls, dirpath: str | Path, name: str = "probe_head") -> ProbeHead:
        """A probe written by :meth:`save_pretrained` (or ``ExportModel``), ready to
        :meth:`predict` / :meth:`score_rollouts`; its row buffer is empty."""
        path = Path(dirpath)
        config = json.loads((path / f"{name}.json").read_text())
        bounds = config["reward_range"]
        head = cls(**{**config, "reward_range": None if bounds is None else tuple(bounds)})
        head.probe.load_state_dict(load_file(str(path / f"{name}.safetensors")))
        return head


def _features(rollouts: Rollouts) -> torch.Tensor:
    if rollouts.probe_features is None:
        raise RuntimeError(
            "The rollouts carry no probe features: RLVRModule.recompute_old_logprobs fills "
            "Rollouts.probe_features before advantages are computed; call it first."
        )
    return rollouts.probe_features

"""Generation stage of ``RLVRModule``: the engine, prompt encoding and ``rollout``.

A mixin, so ``module.py`` keeps the step's orchestration; it reads the module's attributes
(``policy``, ``tokenizer``, ``sampling``, ``hparams``, ``_engine``, ``_engine_synced_at``).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from rlvr_lightning.data.sources import plain_text
from rlvr_lightning.device import weights_cast_once
from rlvr_lightning.environments import SessionFactory
from rlvr_lightning.rollout.base import RolloutEngine, policy_weights
from rlvr_lightning.rollout.factory import build_engine, engine_dtype
from rlvr_lightning.stages.multiturn import multi_turn_rollouts
from rlvr_lightning.types import PromptBatch, Rollouts, Sampling


def _is_chat(batch: PromptBatch) -> bool:
    """Whether a prompt of ``batch`` is more than one user turn's text: a conversational row
    (its ``prompts`` column is a message list) or several messages (a system prompt)."""
    rows = batch.columns.get("prompts") or []
    return any(isinstance(p, list) for p in rows) or any(len(m) > 1 for m in batch.messages)


class GenerationStage(pl.LightningModule):
    """The rollout engine of ``RLVRModule`` and the ``rollout`` stage."""

    _warned_flattened = False  # chat prompts met a tokenizer without a template (set once)
    _sessions: SessionFactory | None = None  # multi-turn tools and environment (stages.build)

    @property
    def sessions(self) -> SessionFactory:
        """The tools and environment of multi-turn rollouts, built with the module (so a bad
        environment fails before any model work)."""
        if self._sessions is None:
            raise RuntimeError("Multi-turn rollouts need multiturn.tools or .environment.")
        return self._sessions

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine, built on first use so that its dtype can follow the trainer's
        precision (the trainer is attached by then in ``fit``/``validate``)."""
        if self._engine is None:
            h = self.hparams
            precision = str(self._trainer.precision) if self._trainer is not None else None
            self._engine = build_engine(
                h.engine,
                h.policy,
                self.policy,
                self.tokenizer,
                engine_dtype(h.dtype, precision),
                h.engine_kwargs,
            )
        return self._engine

    def encode_prompts(self, batch: PromptBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Render each prompt and left-pad: ``([B, P] ids, [B, P] mask)``.

        ``prompt_format`` ``chat`` applies the chat template; ``plain`` joins the messages'
        contents by blank lines, roles dropped; ``auto`` is ``chat`` when the tokenizer has a
        template. No special tokens are added in either case (the template carries its own;
        TRL encodes plain prompts the same way).
        """
        fmt = self.hparams.get("prompt_format", "auto")
        if fmt == "auto":
            fmt = "chat" if getattr(self.tokenizer, "chat_template", None) else "plain"
            if fmt == "plain" and not self._warned_flattened and _is_chat(batch):
                self._warned_flattened = True
                rank_zero_warn(
                    f"The prompts are chat messages but the tokenizer of policy "
                    f"{self.hparams.get('policy')!r} has no chat template: prompt_format=auto "
                    "joins their contents as plain text, roles dropped. Set "
                    "model.init_args.prompt_format: plain to keep that (and this warning "
                    "quiet), or train a model with a chat template."
                )
        texts = [
            plain_text(m)
            if fmt == "plain"
            else self.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
            for m in batch.messages
        ]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return enc.input_ids.to(self.device), enc.attention_mask.to(self.device)

    def rollout(
        self,
        batch: PromptBatch,
        sampling: Sampling | None = None,
        temperatures: torch.Tensor | None = None,
    ) -> Rollouts:
        """Generate ``G`` completions per prompt (``temperatures``: optional ``[B * G]``;
        by default the batch's per-prompt ``temperatures`` when sampling is not greedy; the
        batch's ``position_temperatures`` go to the engine as they are)."""
        sampling = sampling or self.sampling
        temperatures = self._row_temperatures(batch, sampling, temperatures)
        self.sync_engine()
        if self.options.multiturn.enabled:
            with weights_cast_once(self.device.type):
                return multi_turn_rollouts(
                    self.engine, self.tokenizer, self.sessions, batch, sampling,
                    self.options.multiturn, temperatures, self.device,
                )  # fmt: skip
        with weights_cast_once(self.device.type):  # the weights are fixed while it decodes
            *args, position = self.engine_request(batch, sampling, temperatures)
            return self.engine.generate(*args, position_temperatures=position)

    def engine_request(
        self, batch: PromptBatch, sampling: Sampling, temperatures: torch.Tensor | None
    ) -> tuple:
        """The engine's ``generate`` arguments for ``batch`` (single-turn): prompt ids and
        mask, sampling, per-row and per-position temperatures."""
        ids, mask = self.encode_prompts(batch)
        return ids, mask, sampling, temperatures, batch.position_temperatures

    def submit_rollout(self, batch: PromptBatch) -> int:
        """``rollout(batch)`` sent to an engine in its own process (``rollout.process``),
        which decodes while this process goes on; ``engine.collect(ticket)`` gives the rows."""
        temperatures = self._row_temperatures(batch, self.sampling, None)
        self.sync_engine()
        *args, position = self.engine_request(batch, self.sampling, temperatures)
        return self.engine.submit(*args, position_temperatures=position)

    @staticmethod
    def _row_temperatures(
        batch: PromptBatch, sampling: Sampling, temperatures: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``temperatures``, else the batch's per-prompt ones per row when sampling."""
        if temperatures is None and batch.temperatures is not None and sampling.temperature > 0:
            per_prompt = [sampling.temperature if t is None else t for t in batch.temperatures]
            temperatures = torch.tensor(per_prompt).repeat_interleave(sampling.group_size)
        return temperatures

    def sync_engine(self) -> None:
        """Load the policy's weights into an engine that holds its own copy (vLLM), once per
        optimiser step; engines sharing the policy (HF) need nothing."""
        if self.engine.shares_policy or self._engine_synced_at == self.global_step:
            return
        with policy_weights(self.policy) as named:
            self.engine.load_weights(named)
        self._engine_synced_at = self.global_step

"""``StepComposer``: which prompts each training step gets, and the state that decides it.

A step's prompts are replays chosen by ``PromptReplay``, refills from the ``VarianceCurriculum``
memory bank, then fresh prompts in reshuffled epoch order, shuffled together with a seeded RNG.
The composer holds everything that choice depends on (per-prompt statistics, the replay heap,
the bank, the stream position, the RNG) and saves it as plain data, so a resumed run sees
exactly the prompt sequence an uninterrupted run would have seen. It knows nothing of ranks or
loaders: ``RLVRDataModule`` asks it for a global step and keeps its own rank's slice.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from typing import Any

import torch

from rlvr_lightning.data.curriculum import VarianceCurriculum
from rlvr_lightning.data.replay import PromptReplay
from rlvr_lightning.data.sources import Example
from rlvr_lightning.data.stats import (
    Observation,
    PromptStats,
    gather_observations,
    observations,
)
from rlvr_lightning.data.stream import FreshPrompts, StreamCursor, rng_state, set_rng_state
from rlvr_lightning.types import StepOutput


class StepComposer:
    """Composes global training steps from replays, bank refills and fresh prompts.

    Args:
        replay: online prompt replay (spec §1); None disables it.
        curriculum: variance-based curriculum (spec §2); None disables it.
        stats_history: recent pass rates and outcomes kept per prompt.
        seed: seed of the fresh-prompt order and of the step shuffle.
    """

    def __init__(
        self,
        replay: PromptReplay | None,
        curriculum: VarianceCurriculum | None,
        stats_history: int,
        seed: int,
    ) -> None:
        self.replay, self.curriculum, self.seed = replay, curriculum, seed
        self.stats = PromptStats(stats_history)
        self.steps = 0  # training steps reported through observe
        self.last_observed: list[Observation] = []  # the last reported step, all ranks
        self.cursor = StreamCursor()
        self.rng = random.Random(seed)
        self.served: set[str] = set()  # prompts of the current step served as replays
        self.retired: set[str] = set()  # prompts never served again (ExGRPO's skip set)
        self.pending: dict[str, Any] | None = None  # state before the untrained current step
        self._by_id: dict[str, Example] = {}
        self._fresh: FreshPrompts | None = None

    def start(self, examples: Sequence[Example]) -> None:
        """Walk ``examples`` (the training split) from the current stream position."""
        self._by_id = {e.prompt_id: e for e in examples}
        self._fresh = FreshPrompts(examples, self.seed, self.cursor)

    def _fresh_prompts(self) -> FreshPrompts:
        if self._fresh is None:
            raise RuntimeError("StepComposer.start(examples) must run before composing a step.")
        return self._fresh

    def compose(self, total: int) -> list[Example]:
        """The next global step of ``total`` prompts: replays, bank refills, then fresh ones,
        in a seeded order (so replays spread over ranks)."""
        replays, banked = [], []
        if self.replay is not None:
            replays = self.replay.select(self.steps, self.replay.budget(total), self.retired)
        if self.curriculum is not None:
            banked = self.curriculum.fill(total, set(replays) | self.retired)
        served = replays + banked
        fresh = self._fresh_prompts().take(total - len(served), set(served) | self.retired)
        picked = [self._by_id[pid] for pid in served] + fresh
        self.rng.shuffle(picked)
        self.served = set(served)
        return picked

    def draw(self, total: int, exclude: Sequence[str] = ()) -> list[Example]:
        """``total`` more fresh prompts within the current step, none of ``exclude`` or of the
        step's replays."""
        return self._fresh_prompts().take(total, set(exclude) | self.served | self.retired)

    def retire(self, prompt_ids: Sequence[str]) -> None:
        """Never serve ``prompt_ids`` again, fresh, replayed or from the bank (ExGRPO retires
        a question its ``K`` samples all solved: it leaves the data for later epochs)."""
        self.retired.update(prompt_ids)

    def begin_step(self) -> None:
        """Until ``observe`` reports the step about to be composed, ``state_dict`` saves the
        state before it, so a run resumed from a checkpoint written meanwhile (e.g. on an
        exception) trains this step's prompts again."""
        self.pending = self.composition_state()

    def hold_step(self) -> list[str]:
        """The composed step leaves the stream now, not when its outcome is reported: its
        round waits in the module's queue (asynchronous rollouts), saved in the module's
        checkpoints. Returns the step's prompts served again, for ``resume_step``."""
        served, self.served, self.pending = sorted(self.served), set(), None
        return served

    def resume_step(self, served: Sequence[str]) -> None:
        """The step reported next (``observe``) is a held one, which served ``served``."""
        self.served = set(served)

    def group_mask(self, correct: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor | None:
        """``[B]`` bool: groups of ``[B, G]`` results allowed to train (None: all)."""
        if self.curriculum is None:
            return None
        return self.curriculum.group_mask(self.steps, correct.cpu(), rewards.cpu())

    def observe(self, output: StepOutput) -> None:
        """Record a trained step in ``stats`` (gathered across ranks), feed replay and
        curriculum, and keep its observations in ``last_observed`` until the next step."""
        observed = gather_observations(observations(output, self.served))
        self.last_observed = observed
        self.stats.record(self.steps, observed)
        if self.replay is not None:
            self.replay.observe(self.steps, observed)
            # A replay a callback displaced (ExGRPO's mix-in) was never observed: release it.
            self.replay.release(self.served - {o.prompt_id for o in observed})
        if self.curriculum is not None:
            scores = [self.curriculum.observation_score(o) for o in observed]
            trained = [o.trained for o in observed]
            self.curriculum.observe(self.steps, [o.prompt_id for o in observed], scores, trained)
        self.steps += 1
        self.pending, self.served = None, set()

    # --- checkpoints ---------------------------------------------------------------------

    def composition_state(self) -> dict[str, Any]:
        """What composing a step changes; restored when a step was composed but not trained."""
        return copy.deepcopy(
            {
                "epoch": self.cursor.epoch,
                "index": self.cursor.index,
                "rng": rng_state(self.rng),
                "replay": None if self.replay is None else self.replay.state_dict(),
                "curriculum": None if self.curriculum is None else self.curriculum.state_dict(),
            }
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            **(self.pending or self.composition_state()),
            "seed": self.seed,
            "steps": self.steps,
            "stats": self.stats.state_dict(),
            "retired": sorted(self.retired),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict``; raises when the run is configured unlike the checkpoint."""
        if state_dict["seed"] != self.seed:
            raise ValueError(
                f"The checkpoint's prompt stream used seed={state_dict['seed']}, this run has "
                f"seed={self.seed}; set seed: {state_dict['seed']} to resume, or start a new run."
            )
        for name in ("replay", "curriculum"):
            if (state_dict.get(name) is None) != (getattr(self, name) is None):
                raise ValueError(
                    f"The checkpoint was written {'with' if state_dict.get(name) else 'without'} "
                    f"data.{name}; configure it the same way to resume exactly."
                )
        self.cursor.epoch, self.cursor.index = state_dict["epoch"], state_dict["index"]
        set_rng_state(self.rng, state_dict["rng"])
        if self.replay is not None:
            self.replay.load_state_dict(state_dict["replay"])
        if self.curriculum is not None:
            self.curriculum.load_state_dict(state_dict["curriculum"])
        self.stats.load_state_dict(state_dict["stats"])
        self.retired = set(state_dict.get("retired", []))  # absent in older checkpoints
        self.steps, self.pending = state_dict["steps"], None

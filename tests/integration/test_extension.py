"""A user's own loss, reward and module subclass, chosen by import path from YAML."""

import sys
import textwrap

import pytest

from rlvr_lightning.cli.main import build_cli

USER_MODULE = """
import torch
from rlvr_lightning import RLVRModule
from rlvr_lightning.algorithms.losses import ppo_clip_loss

CALLS = {"loss": 0, "reward": 0, "advantages": 0}


def halved_ppo(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip=None):
    CALLS["loss"] += 1
    loss, metrics = ppo_clip_loss(logp, old_logp, advantages, mask, clip_low=clip_low,
                                  clip_high=clip_high, dual_clip=dual_clip)
    return 0.5 * loss, metrics


def count_letters(completions, answer, **_):
    CALLS["reward"] += 1
    return [float(sum(c.isalpha() for c in t)) for t in completions]


class SignAdvantages(RLVRModule):
    def compute_advantages(self, scored):
        CALLS["advantages"] += 1
        return torch.sign(super().compute_advantages(scored))
"""

YAML = """
seed_everything: 0
trainer:
  accelerator: cpu
  max_steps: 2
  limit_val_batches: 0
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
model:
  class_path: my_rl.SignAdvantages
  init_args:
    policy: "tiny:0"
    loss: {fn: my_rl.halved_ppo}
    rewards:
      functions: [my_rl.count_letters, rlvr_lightning.rewards.boxed_format]
      weights: [1.0, 0.5]
    sampling: {max_new_tokens: 8, group_size: 4}
data:
  class_path: rlvr_lightning.RLVRDataModule
  init_args: {source: addition, train_size: 16, val_size: 4, prompts_per_step: 2}
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rl.py").write_text(textwrap.dedent(USER_MODULE))
    (tmp_path / "run.yaml").write_text(YAML)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)  # the CLI saves its config.yaml in the working directory
    yield tmp_path
    sys.modules.pop("my_rl", None)


def test_custom_loss_reward_and_subclass_from_yaml(user_module):
    cli = build_cli(["fit", "--config", str(user_module / "run.yaml")])
    import my_rl

    assert type(cli.model).__name__ == "SignAdvantages"
    assert my_rl.CALLS["advantages"] == 2
    assert my_rl.CALLS["reward"] >= 2
    assert my_rl.CALLS["loss"] >= 2
    assert cli.model.rewards.names == ["count_letters", "boxed_format"]

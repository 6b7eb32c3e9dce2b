"""The module's argument groups: dicts become dataclasses, old keys move to their groups."""

import dataclasses

import pytest

from rlvr_lightning.options import (
    GROUPS,
    MOVED,
    Loss,
    Options,
    Update,
    as_group,
    moved_message,
    regroup,
)


def test_every_moved_key_names_a_real_field():
    for old, new in MOVED.items():
        group, field = new.split(".")
        assert field in {f.name for f in dataclasses.fields(GROUPS[group])}, old


def test_a_checkpoints_flat_hyperparameters_move_into_their_groups():
    flat = {"policy": "tiny:0", "kl_coef": 0.1, "lr": 3e-5, "lora_rank": 4, "loss_fn": None,
            "reward_fns": ["a.b"], "loss": {"clip_low": 0.3}}  # fmt: skip
    out = regroup(flat)
    assert out == {
        "policy": "tiny:0",
        "loss": {"clip_low": 0.3, "kl_coef": 0.1, "fn": None},
        "update": {"lr": 3e-5},
        "lora": {"rank": 4},
        "rewards": {"functions": ["a.b"]},
    }
    options = Options.of(**{k: v for k, v in out.items() if k in GROUPS})
    assert options.loss == Loss(clip_low=0.3, kl_coef=0.1)
    assert options.update.lr == 3e-5 and options.lora.rank == 4


def test_as_group_takes_a_dataclass_a_dict_or_none():
    assert as_group(Update, None) == Update()
    assert as_group(Update, {"lr": 2.0}) == Update(lr=2.0)
    same = Update(lr=3.0)
    assert as_group(Update, same) is same
    with pytest.raises(TypeError):
        as_group(Update, {"learning_rate": 1.0})


def test_moved_message_only_for_moved_keys():
    assert "model.init_args.loss.kl_coef" in moved_message("kl_coef")
    assert "model.init_args.rewards.functions" in moved_message("reward_fns")
    assert moved_message("policy") is None and moved_message("nonsense") is None

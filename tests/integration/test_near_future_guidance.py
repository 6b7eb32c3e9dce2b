"""NPO on a tiny model: the look-ahead restores the run exactly (its guide equals the weights a
run without look-ahead reaches Δ steps later), verified guide trajectories are injected into
failing groups as on-policy samples, manual guides load from a checkpoint, AutoNPO chooses Δ
by S, and the callback's state survives a weights_only checkpoint round trip."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rlvr_lightning.callbacks import NearFuturePolicyGuidance

from rlvr_lightning import RLVRModule
from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.stages.hooks import RLVRCallback
from rlvr_lightning.testing import digit_fraction, grouped, quiet_trainer
from rlvr_lightning.types import Sampling


def has_digit(completions, **_):
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


class Spy(RLVRCallback):
    """Keeps every scored batch the update sees (after the other hooks)."""

    def __init__(self):
        self.scored = []

    def on_after_score(self, trainer, module, scored):
        self.scored.append(scored)


def _fit(callbacks, steps, tmp_path=None, ckpt_every=False):
    torch.manual_seed(0)
    module = RLVRModule(
        "tiny:0",
        **grouped(
            reward_fns=[has_digit, digit_fraction],
            sampling=Sampling(max_new_tokens=8, temperature=1.0, group_size=4),
            micro_batch_size=8,
            lr=1e-2,
        ),
    )
    data = RLVRDataModule("addition", train_size=16, val_size=2, prompts_per_step=4)
    extra = {}
    if tmp_path is not None:
        extra = {"default_root_dir": tmp_path, "enable_checkpointing": True}
        callbacks = [*callbacks, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)]
    trainer = quiet_trainer(max_steps=steps, callbacks=callbacks, **extra)
    trainer.fit(module, datamodule=data)
    return trainer, module, data


def _params(module):
    return {n: p.detach().clone() for n, p in module.policy.named_parameters()}


def test_lookahead_restores_the_run_exactly():
    _, plain, plain_data = _fit([], steps=4)
    npo_cb = NearFuturePolicyGuidance(
        mode="lookahead", intervene_at=[2], lookahead=2, duration=5, accuracy_gate=0.0
    )
    trainer, guided, data = _fit([npo_cb], steps=4)
    # gate 0: nothing is injected, so the run must be the plain run, bit for bit
    a, b = _params(plain), _params(guided)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert trainer.global_step == 4 and guided._rollout_step == 4
    assert data.state_dict()["steps"] == plain_data.state_dict()["steps"] == 4
    assert data.state_dict()["index"] == plain_data.state_dict()["index"]
    # the guide trained steps 2 and 3 ahead on the same prompts and RNG: the plain run's end
    assert npo_cb.guide_step == 4 and npo_cb.delta == 2
    assert all(torch.equal(npo_cb.guide_weights[n], a[n]) for n in a)
    logged = trainer.logged_metrics
    assert float(logged["train/npo/active"]) == 1.0
    assert float(logged["train/npo/guided_groups"]) == 0.0


def test_lookahead_injects_verified_guide_samples_as_on_policy():
    spy = Spy()
    npo_cb = NearFuturePolicyGuidance(
        mode="lookahead", intervene_at=[1], lookahead=1, duration=3, guide_samples=8
    )
    trainer, _, _ = _fit([npo_cb, spy], steps=3)
    guided_steps = spy.scored[1:]
    injected = 0
    for scored in guided_steps:
        sampled = scored.sampled_correct.view(-1, 4).float().mean(1)  # [B]
        tags = scored.rollouts.sources or ("policy",) * scored.rollouts.num_rows
        for row, tag in enumerate(tags):
            if tag != "npo":
                continue
            injected += 1
            assert bool(scored.correct[row])  # verified correct
            assert float(sampled[row // 4]) < 0.6  # only failing groups are guided
            assert int(scored.rollouts.offpolicy_mask[row].sum()) == 0  # trained as on-policy
    assert injected > 0
    assert "npo" not in (spy.scored[0].rollouts.sources or ())  # none before the intervention
    assert float(trainer.logged_metrics["train/npo/active"]) == 1.0


def test_manual_guide_from_a_checkpoint_and_bad_paths(tmp_path):
    _fit([], steps=2, tmp_path=tmp_path)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    spy = Spy()
    npo_cb = NearFuturePolicyGuidance(
        mode="manual", guide_checkpoint=str(ckpt), intervene_at=[0], duration=2, guide_samples=8
    )
    trainer, _, _ = _fit([npo_cb, spy], steps=2)
    tags = [t for s in spy.scored for t in (s.rollouts.sources or ())]
    assert "npo" in tags
    assert float(trainer.logged_metrics["train/npo/guide_step"]) == 0.0
    with pytest.raises(FileNotFoundError, match="guide_checkpoint"):
        _fit(
            [
                NearFuturePolicyGuidance(
                    mode="manual", guide_checkpoint="nope.ckpt", intervene_at=[0]
                )
            ],
            1,
        )
    with pytest.raises(ValueError, match="guide_checkpoint"):
        NearFuturePolicyGuidance(mode="manual", intervene_at=[0])
    with pytest.raises(ValueError, match="intervene_at"):
        NearFuturePolicyGuidance(mode="lookahead")


def test_auto_chooses_delta_by_effective_signal_and_state_round_trips(tmp_path):
    npo_cb = NearFuturePolicyGuidance(
        mode="auto",
        candidates=[1, 2],
        window=1,
        min_reward_gain=10.0,  # always a plateau: trigger as soon as two steps exist
        min_gap=0,
        duration=2,
        guide_samples=4,
    )
    trainer, _, _ = _fit([npo_cb], steps=4, tmp_path=tmp_path)
    logged = trainer.logged_metrics
    assert npo_cb.interventions >= 1
    assert npo_cb.delta in (1, 2)
    s = {d: float(logged[f"train/npo/S@{d}"]) for d in (1, 2)}
    q = {d: float(logged[f"train/npo/Q@{d}"]) for d in (1, 2)}
    v = {d: float(logged[f"train/npo/V@{d}"]) for d in (1, 2)}
    for d in (1, 2):
        assert s[d] == pytest.approx(q[d] / max(v[d], 1e-3), rel=1e-5)
    assert npo_cb.delta == min(s, key=lambda d: (-s[d], d))
    # the state (pool, histories, guide weights) survives a weights_only round trip
    state = npo_cb.state_dict()
    path = tmp_path / "npo_state.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    other = NearFuturePolicyGuidance(mode="auto", candidates=[1, 2])
    other.load_state_dict(loaded)
    again = other.state_dict()
    assert again["pool"] == state["pool"] and again["rewards"] == state["rewards"]
    assert again["slot_rng"] == state["slot_rng"]
    if state["guide_weights"] is not None:
        assert all(
            torch.equal(again["guide_weights"][k], v) for k, v in state["guide_weights"].items()
        )
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert any(k.startswith("NearFuturePolicyGuidance") for k in ckpt["callbacks"])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_npo_config_runs_through_the_cli(tmp_path, monkeypatch):
    from pathlib import Path

    from rlvr_lightning.cli.main import build_cli

    config = Path(__file__).parents[2] / "configs" / "npo.yaml"
    monkeypatch.chdir(tmp_path)
    cli = build_cli(
        [
            "fit", "--config", str(config),
            "--model.init_args.policy=tiny:0",
            "--model.init_args.sampling={max_new_tokens: 6, temperature: 1.0, group_size: 4}",
            "--model.init_args.val_sampling={max_new_tokens: 6, temperature: 0.0}",
            "--trainer.precision=32-true", "--trainer.max_steps=6",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
            "--data.init_args.val_size=4", "--evaluate_before_after=false",
        ]
    )  # fmt: skip
    (npo_cb,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, NearFuturePolicyGuidance)]
    assert npo_cb.mode == "lookahead" and npo_cb.intervene_at == [4]
    # looked ahead 4 steps at step 4, then guided steps 4 and 5
    assert cli.trainer.global_step == 6 and npo_cb.interventions == 1
    assert npo_cb.guide_step == 8 and npo_cb.active_until == 12


def test_auto_without_mistakes_never_looks_ahead(monkeypatch):
    from rlvr_lightning.guidance import lookahead

    def fail(*args, **kwargs):
        raise AssertionError("looked ahead with an empty mistake pool")

    monkeypatch.setattr(lookahead, "train_ahead", fail)
    npo_cb = NearFuturePolicyGuidance(mode="auto", window=1, min_reward_gain=10.0, min_gap=0)
    torch.manual_seed(0)
    module = RLVRModule(
        "tiny:0",
        **grouped(
            reward_fns=[lambda completions, **_: [1.0] * len(completions), digit_fraction],
            sampling=Sampling(max_new_tokens=6, temperature=1.0, group_size=4),
        ),
    )
    data = RLVRDataModule("addition", train_size=8, val_size=2, prompts_per_step=2)
    trainer = quiet_trainer(max_steps=4, callbacks=[npo_cb])
    trainer.fit(module, datamodule=data)
    assert npo_cb.triggered is False and npo_cb.interventions == 0 and len(npo_cb.pool) == 0
    assert float(trainer.logged_metrics["train/npo/skipped_no_mistakes"]) == 1.0

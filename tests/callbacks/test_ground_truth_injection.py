"""GroundTruthInjection on the tiny in-process model: members, gating, reward control."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rlvr_lightning.callbacks import GroundTruthInjection

from rlvr_lightning import RLVRModule
from rlvr_lightning.cli.main import build_cli
from rlvr_lightning.data.sources import Example
from rlvr_lightning.rewards import boxed_format, extract_boxed
from rlvr_lightning.testing import grouped
from rlvr_lightning.types import PromptBatch, Sampling

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")


def fake_accuracy(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """Every sample of the prompt whose answer is ``easy`` is correct; otherwise a boxed match."""
    return [
        float(a == "easy" or extract_boxed(c) == a)
        for c, a in zip(completions, answer, strict=True)
    ]


@pytest.fixture(scope="module")
def module() -> RLVRModule:
    return RLVRModule(
        "tiny:0",
        **grouped(
            reward_fns=[fake_accuracy, boxed_format],
            sampling=Sampling(max_new_tokens=6, temperature=1.0, group_size=4),
        ),
    )


def _batch() -> PromptBatch:
    return PromptBatch(
        prompt_ids=["p0", "p1"],
        messages=[[{"role": "user", "content": "q0"}], [{"role": "user", "content": "q1"}]],
        columns={"answer": ["easy", "7"]},
    )


def _run(module: RLVRModule, cb: GroundTruthInjection):
    batch = _batch()
    cb.on_before_rollout(None, module, batch)
    torch.manual_seed(0)
    return cb.on_after_score(None, module, module.score(batch, module.rollout(batch)))


def test_gated_injection_replaces_one_wrong_sample_of_failing_groups(module):
    out = _run(module, GroundTruthInjection())
    ro = out.rollouts
    # Group 0 is all correct: untouched. Group 1 all wrong: its last row holds the reference.
    assert ro.sources == ("policy",) * 7 + ("reference",)
    assert ro.completions[7] == "The answer is \\boxed{7}."
    ids = module.tokenizer("The answer is \\boxed{7}.", add_special_tokens=False).input_ids
    n = len(ids) + 1  # + EOS
    assert ro.completion_ids[7, :n].tolist() == [*ids, module.tokenizer.eos_token_id]
    assert ro.offpolicy_mask[7].sum() == n and ro.offpolicy_mask[:7].sum() == 0
    assert ro.completion_mask[7].sum() == n
    # Template alignment: accuracy 1 and format 1 -> reward 2.
    assert out.rewards[7].item() == 2.0 and out.correct[7]
    assert out.metrics["gt_injection/injected_groups"] == 1.0
    assert out.metrics["source/reference/count"] == 1.0


def test_reward_capping_keeps_reference_out_of_baseline_and_caps_it(module):
    out = _run(module, GroundTruthInjection())
    assert out.baseline_mask.tolist() == [True] * 7 + [False]
    # 3 on-policy baseline members, gap 2 - 0 > 0: cap (3 - 1) / sqrt(3) = 1.1547.
    assert out.advantage_cap[7].item() == pytest.approx(1.1547, abs=1e-4)
    adv = module.compute_advantages(out)
    assert adv[7].item() == pytest.approx(1.1547, abs=1e-4)
    assert torch.equal(adv[4:7], torch.zeros(3))  # the wrong samples keep a zero baseline


def test_without_capping_the_reference_joins_the_group_statistics(module):
    out = _run(module, GroundTruthInjection(reward_capping=False))
    assert out.baseline_mask is None and out.advantage_cap is None
    # Group 1 = [0, 0, 0, 2]: mean 0.5, unbiased std 1 -> reference advantage 1.5.
    assert module.compute_advantages(out)[7].item() == pytest.approx(1.5, abs=1e-4)


def test_gating_off_injects_everywhere_and_prefers_wrong_slots(module):
    out = _run(module, GroundTruthInjection(max_pass_rate=None))
    # Group 0 has no wrong sample: its last (correct) one is replaced.
    assert [i for i, s in enumerate(out.rollouts.sources) if s == "reference"] == [3, 7]
    assert out.rollouts.completions[3] == "The answer is \\boxed{easy}."


def test_without_template_alignment_the_raw_answer_loses_the_format_reward(module):
    out = _run(module, GroundTruthInjection(template_alignment=False))
    assert out.rollouts.completions[7] == "7"
    assert out.per_function["boxed_format"][7].item() == 0.0


def _trainer(columns: dict[str, str]) -> SimpleNamespace:
    example = Example("id", "q", columns)
    return SimpleNamespace(datamodule=SimpleNamespace(train_examples=[example]))


def test_setup_explains_incompatible_configs(module):
    cb = GroundTruthInjection()
    cb.setup(_trainer({"answer": "1"}), module, "fit")
    with pytest.raises(ValueError, match=r"data\.columns"):
        cb.setup(_trainer({"task": "x"}), module, "fit")
    small = RLVRModule("tiny:0", sampling=Sampling(max_new_tokens=4, group_size=2))
    with pytest.raises(ValueError, match="group_size >= 3"):
        cb.setup(_trainer({"answer": "1"}), small, "fit")
    GroundTruthInjection(reward_capping=False).setup(_trainer({"answer": "1"}), small, "fit")
    rloo = RLVRModule("tiny:0", estimator="rloo", sampling=Sampling(max_new_tokens=4, group_size=4))
    with pytest.raises(ValueError, match="estimator grpo or dr_grpo"):
        cb.setup(_trainer({"answer": "1"}), rloo, "fit")


def test_fit_through_the_cli_logs_per_source_metrics(tmp_path):
    cli = build_cli(
        [
            "fit",
            "--config",
            CONFIG,
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.callbacks+=rlvr_lightning.callbacks.GroundTruthInjection",
            "--model.init_args.offpolicy.weighting=on_policy",
        ]
    )
    logged = cli.trainer.logged_metrics
    assert cli.trainer.global_step == 2
    assert "train/gt_injection/injected_groups" in logged
    assert logged["train/source/reference/count"] >= 1
    assert "train/source/reference/loss_share" in logged

"""The pairs of mechanisms that cannot work together are refused at setup, with the fix.

Refused (``test_combinations.REFUSED``): value head + probe head (one estimator reads one
head); ground-truth injection's reward capping + value head or probe head (capping needs a
group baseline, ``grpo`` or ``dr_grpo``). Refused outside the default matrix: a curriculum
that judges the sampled rows + an injection only into all-wrong groups (GroundTruthInjection
``max_pass_rate: 0``, AMPO's ``on_all_fail``), which it would always mask (issue 37, D3). The
first are checked on the objects, the last also through the CLI, as a user meets it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from rlvr_lightning.callbacks import GroundTruthInjection, MixedPolicyGuidance

from rlvr_lightning import RLVRModule
from rlvr_lightning.cli.main import main
from rlvr_lightning.data.curriculum import VarianceCurriculum
from rlvr_lightning.heads import ProbeHead, ValueHead
from rlvr_lightning.testing import tiny_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("estimator", "message"),
    [
        ("gae", "probe_head is set but estimator 'gae' never reads its predictions"),
        ("probe", "value_head is set but estimator 'probe' never reads values"),
    ],
)
def test_value_head_and_probe_head_are_refused_together(estimator, message):
    with pytest.raises(ValueError, match=message):
        RLVRModule("tiny:0", estimator=estimator, value_head=ValueHead, probe_head=ProbeHead)


@pytest.mark.parametrize(("estimator", "head"), [("gae", "value_head"), ("probe", "probe_head")])
def test_reward_capping_is_refused_with_a_head_estimator(estimator, head):
    module = tiny_module(
        estimator=estimator, **{head: ValueHead if head == "value_head" else ProbeHead}
    )
    trainer = SimpleNamespace(datamodule=None)
    with pytest.raises(
        ValueError, match=f"reward_capping needs estimator grpo or dr_grpo, not '{estimator}'"
    ):
        GroundTruthInjection().setup(trainer, module, "fit")
    GroundTruthInjection(reward_capping=False).setup(trainer, module, "fit")  # the fix works


@pytest.mark.parametrize(
    "callback",
    [
        lambda: GroundTruthInjection(),
        lambda: MixedPolicyGuidance(source="teacher", injection="on_all_fail", num_replaced=2),
    ],
)
def test_a_sampled_rows_curriculum_with_all_wrong_injection_is_refused(callback):
    module = tiny_module()
    judged = SimpleNamespace(datamodule=SimpleNamespace(
        curriculum=VarianceCurriculum(judge="sampled"), train_examples=[])
    )  # fmt: skip
    with pytest.raises(ValueError, match="judge: sampled, so its κ mask scores those groups 0"):
        callback().setup(judged, module, "fit")
    for fix in (VarianceCurriculum(), VarianceCurriculum(0.0, 0.0, judge="sampled")):
        ok = SimpleNamespace(datamodule=SimpleNamespace(curriculum=fix, train_examples=[]))
        callback().setup(ok, module, "fit")


def test_the_refusal_reaches_a_cli_user_in_a_few_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = [
        "fit", "--config", str(ROOT / "configs" / "tiny.yaml"),
        "--trainer.callbacks+=rlvr_lightning.callbacks.GroundTruthInjection",
        "--data.init_args.curriculum=rlvr_lightning.data.curriculum.VarianceCurriculum",
        "--data.init_args.curriculum.judge=sampled",
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    err = err[err.index("rlvr-lightning") :].strip()
    assert err.startswith("rlvr-lightning fit: error") and len(err.splitlines()) < 8, err
    assert "judge: sampled" in err and "judge: trained" in err and "Traceback" not in err

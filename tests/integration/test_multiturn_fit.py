"""Multi-turn rollouts in a whole fit: TRL-style tools and environments run unchanged, execution
feedback retries, per-turn metrics are logged, and a resumed multi-turn run is bit-identical to
an uninterrupted one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from rlvr_lightning.cli.main import build_cli
from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.testing import checkpointing_args, quiet_trainer, tiny_module

ROOT = Path(__file__).parents[2]
CONFIG = str(ROOT / "configs" / "tiny.yaml")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def eos_prone(model: torch.nn.Module, boost: float = 3.0) -> None:
    """Make the random tiny policy end its turns often (a logit boost on EOS at generation), so
    trajectories reach their environment turns; training's forward is left alone."""
    eos = model.generation_config.eos_token_id

    def hook(_module, _args, output):
        output.logits[..., eos] += boost
        return output

    model.register_forward_hook(hook)


class Counter:
    """A TRL-style environment (the shape of TRL's docs example): a tool method, ``reset`` and
    ``get_reward``; never imports anything of this project."""

    def reset(self, **kwargs) -> str | None:
        self.count = 0
        return " You may call increment."

    def increment(self, step: int) -> str:
        """Add ``step`` to the counter.

        Args:
            step: how much to add.
        """
        self.count += step
        return str(self.count)

    def get_reward(self) -> float:
        return float(self.count)


def shout(text: str) -> str:
    """Repeat a text in capitals.

    Args:
        text: what to repeat.
    """
    return text.upper()


def _fit(module, steps: int = 2, **trainer):
    data = RLVRDataModule(source="addition", train_size=16, val_size=4, prompts_per_step=2)
    trainer = quiet_trainer(max_steps=steps, **trainer)
    trainer.fit(module, datamodule=data)
    return trainer


def test_a_trl_environment_class_and_tools_list_run_unchanged() -> None:
    module = tiny_module(environment=Counter, tools=[shout], max_turns=3)
    eos_prone(module.policy)
    seen, prompts = [], []
    module.publish = lambda output, _p=module.publish: (seen.append(output), _p(output))[1]
    rollout = module.rollout

    def keep_prompts(*args, **kwargs):
        out = rollout(*args, **kwargs)
        prompts.append(module.tokenizer.decode(out.prompt_ids[0], skip_special_tokens=True))
        return out

    module.rollout = keep_prompts
    _fit(module, steps=1)
    metrics = seen[0].metrics
    assert metrics["multiturn/turns"] >= 1.0
    assert "multiturn/tool_errors" in metrics and "multiturn/tokens_trained" in metrics
    assert metrics["multiturn/tokens_trained"] <= metrics["multiturn/tokens_seen"]
    # get_reward() joined the rewards, with weight 1, under "environment".
    assert "environment" in seen[0].per_function
    # The tools' description reached the prompt (the tiny template does not render tools),
    # and reset()'s text was appended to the user turn.
    assert "increment" in prompts[0] and "shout" in prompts[0]
    assert "You may call increment." in prompts[0]


def test_execution_feedback_retries_and_logs_first_and_final_accuracy() -> None:
    from rlvr_lightning.environments import ExecutionFeedback

    module = tiny_module(environment=ExecutionFeedback, max_turns=3)
    eos_prone(module.policy)
    seen = []
    module.publish = lambda output, _p=module.publish: (seen.append(output), _p(output))[1]
    _fit(module, steps=1)
    m = seen[0].metrics
    assert m["multiturn/turns"] > 1.0  # wrong answers got feedback and another turn
    assert 0.0 <= m["multiturn/first_turn_accuracy"] <= m["accuracy"] + 1e-9
    table = seen[0].completions
    assert any("[user]" in text for text in table)  # the feedback turn is readable


def _cli(root: Path, *extra: str):
    args = [
        "--config", CONFIG, f"--trainer.default_root_dir={root}",
        "--trainer.limit_val_batches=0", "--trainer.max_steps=4",
        "--model.init_args.multiturn.environment=rlvr_lightning.environments.ExecutionFeedback",
        "--model.init_args.multiturn.max_turns=3", *extra,
    ]  # fmt: skip
    c = build_cli(args, run=False)
    eos_prone(c.model.policy)
    return c


def _ckpt_flags(root: Path) -> list[str]:
    """``last.ckpt`` under ``<root>/ckpt``, written only on a signal (and at the end)."""
    more = [
        "--trainer.callbacks.every_n_train_steps=100",
        "--trainer.callbacks.save_on_exception=true",
    ]
    return [*checkpointing_args(root), *more]


def test_a_multi_turn_run_resumed_mid_run_is_bit_identical(tmp_path) -> None:
    full = _cli(tmp_path / "full")
    full.trainer.fit(full.model, datamodule=full.datamodule)
    assert full.model.last_step.metrics["multiturn/turns"] > 1.0  # feedback turns happened
    c = _cli(tmp_path / "cut", *_ckpt_flags(tmp_path / "cut"))
    calls, original = [0], c.model.score

    def score(*args, **kwargs):  # SIGINT as step 2's rollouts are scored
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    c.model.score = score
    with pytest.raises(SystemExit):
        c.trainer.fit(c.model, datamodule=c.datamodule)
    last = tmp_path / "cut" / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 2
    resumed = _cli(tmp_path / "cut", *_ckpt_flags(tmp_path / "cut"))
    resumed.trainer.fit(resumed.model, datamodule=resumed.datamodule, ckpt_path=last)
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _fit_stops(capsys, *args: str) -> str:
    """``rlvr-lightning fit`` on the tiny config stops with exit 1 in a few lines, no traceback."""
    from rlvr_lightning.cli.main import main

    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", CONFIG, *args])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    err = err[err.index("rlvr-lightning fit: error") :]
    assert "Traceback" not in err and len(err.splitlines()) < 6, err
    return err


def test_cli_refuses_turns_nobody_answers(capsys) -> None:
    err = _fit_stops(capsys, "--model.init_args.multiturn.max_turns=3")
    assert "no tools or environment" in err and "max_turns: 1" in err


def test_cli_refuses_a_tool_given_as_the_environment_before_training(capsys) -> None:
    env = "--model.init_args.multiturn.environment=rlvr_lightning.environments.calculator"
    err = _fit_stops(capsys, env)
    assert "without arguments" in err and "tools" in err


def test_the_model_card_names_tools_environment_and_turns() -> None:
    from rlvr_lightning.hub.card_lines import multiturn_line

    assert multiturn_line({"max_turns": 1}) is None
    line = multiturn_line(
        {"tools": ["rlvr_lightning.environments.calculator"], "environment": Counter,
         "max_turns": 4}
    )  # fmt: skip
    assert line == "up to 4 model turns per trajectory; tools: `calculator`; environment: `Counter`"

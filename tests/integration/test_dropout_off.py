"""Dropout off for RL: on an on-policy step, ``pi / pi_old`` is exactly 1 on a GPT-2-style
model whose config has dropout 0.1; ``keep_dropout: true`` gives the old behaviour back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlvr_lightning.cli.main import build_cli
from rlvr_lightning.testing import byte_tokenizer

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def gpt2_folder(path: Path) -> Path:
    """A random 2-layer GPT-2 with every dropout at 0.1 and the byte tokenizer, saved."""
    tok = byte_tokenizer()
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=512,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("keep_dropout", [False, True])
def test_on_policy_ratio_is_exactly_one_with_dropout_off(tmp_path, keep_dropout):
    """Before (and with ``keep_dropout: true``): the update ran in train() mode with dropout,
    the pi_old pass without, per-token ratios 0.011-3.9. Now every rate is 0 at load."""
    cli = build_cli(
        [
            "--config",
            CONFIG,
            f"--model.init_args.policy={gpt2_folder(tmp_path / 'gpt2')}",
            # pi_old from the trainer's no-grad pass (not the sampler's decoding, which adds
            # its own rounding), two epochs per rollout step (with one step pi_old would be
            # the update's own forward, detached); the first epoch is on-policy.
            "--model.init_args.correction.old_logprobs=trainer",
            "--model.init_args.update.epochs_per_rollout=2",
            f"--model.init_args.keep_dropout={str(keep_dropout).lower()}",
            "--trainer.limit_val_batches=0",
        ],
        run=False,
    )
    log_ratios = []
    loss_fn = cli.model.updater.loss_fn

    def recording(logp, old_logp, advantages, mask, **kwargs):
        if cli.trainer.global_step % 2 == 0:  # the rollout step's first optimiser step
            log_ratios.append((logp - old_logp).detach()[mask.bool()])  # [tokens]
        return loss_fn(logp, old_logp, advantages, mask, **kwargs)

    cli.model.updater = type(cli.model.updater)(
        **{**cli.model.updater.__dict__, "loss_fn": recording}
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    ratios = torch.cat(log_ratios).exp()  # [on-policy tokens of both rollout steps]
    assert cli.trainer.global_step == 2 and len(log_ratios) == 2 and ratios.numel() > 0
    dropouts = [m.p for m in cli.model.policy.modules() if isinstance(m, torch.nn.Dropout)]
    if keep_dropout:
        assert set(dropouts) == {0.1}
        assert (ratios - 1).abs().max() > 0.05, ratios
    else:
        assert dropouts and set(dropouts) == {0.0}
        assert cli.model.policy.config.attn_pdrop == 0.0
        # 1 up to float rounding: SDPA (the attention the fast-path measurement or the
        # reference mode picks here) may take another kernel with and without grad, ~5e-7;
        # dropout's deviations are 0.01-3.9 (the branch above).
        assert (ratios - 1).abs().max() < 1e-5, torch.cat(log_ratios).abs().max()

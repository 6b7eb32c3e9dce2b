"""``rlvr-lightning fit|validate|test|predict`` through LightningCLI, and ``push`` (Hub upload).

Every Trainer gets ``checkpointing.AtomicCheckpointIO`` (unless another CheckpointIO plugin is
configured) and a ``checkpointing.CheckpointGuard``. Exit codes: 0 done, 1 error, 130 stopped
by SIGINT, 143 stopped by SIGTERM (128 + signal number, after the on-exception checkpoints).
"""

from __future__ import annotations

import sys
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.nn import Module
from torchmetrics import Metric

from rlvr_lightning import checkpointing
from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.module import RLVRModule


class RLVRCLI(LightningCLI):
    """LightningCLI with an optional validation before and after ``fit``.

    With ``evaluate_before_after: true`` (the quickstart sets it), ``fit`` first validates the
    untrained policy, trains, validates again and prints both results side by side.
    """

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            "--evaluate_before_after",
            type=bool,
            default=False,
            help="fit only: validate before and after training and compare.",
        )

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads the hyperparameters of `--ckpt_path` first: say which file is
        # broken (and which one is not) before its torch.load fails with a zip error.
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if path and path not in ("last", "best", "hpc", "registry"):
            checkpointing.check_loadable(path)
        super()._parse_ckpt_path()

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        config = {**config, "plugins": checkpointing.with_atomic_io(config.get("plugins"))}
        return super()._instantiate_trainer(config, checkpointing.with_guard(callbacks))

    def _evaluate(self) -> dict[str, float]:
        results = self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
        reset_metric_states(self.model)
        return {k: float(v) for k, v in (results[0] if results else {}).items()}

    def before_fit(self) -> None:
        self._before = self._evaluate() if self._flag() else None

    def after_fit(self) -> None:
        if self._before is None or self.trainer.interrupted:
            return
        after = self._evaluate()
        print("\nValidation before -> after training")
        for key in sorted(set(self._before) | set(after)):
            b, a = self._before.get(key, float("nan")), after.get(key, float("nan"))
            print(f"  {key:<24} {b:8.4f} -> {a:8.4f}  ({a - b:+.4f})")

    def _flag(self) -> bool:
        return bool(self.config.get(self.subcommand, {}).get("evaluate_before_after", False))


def reset_metric_states(module: Module) -> None:
    """Re-create every torchmetrics state of ``module`` as a normal tensor.

    ``trainer.validate`` runs under ``torch.inference_mode``, so the metric states it leaves
    behind are inference tensors; a validation inside ``fit`` (``val_check_interval``) runs
    under ``no_grad`` and cannot update them in place. ``reset`` outside inference mode clones
    the defaults again.
    """
    for metric in module.modules():
        if isinstance(metric, Metric):
            metric.reset()


def build_cli(args: list[str] | None = None, run: bool = True) -> RLVRCLI:
    """Parse ``args`` (default: ``sys.argv``) and run the subcommand; returns the CLI object."""
    return RLVRCLI(
        RLVRModule,
        RLVRDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``rlvr-lightning`` command; ``args`` makes it callable from tests."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["push"]:  # not a Trainer subcommand: handled before LightningCLI parses
        from rlvr_lightning.push_cli import push_command

        push_command(argv[1:])
        return
    try:
        build_cli(args)
    except SIGTERMException as stop:  # Lightning's own SIGTERM stop exits 0 otherwise
        raise SystemExit(143) from stop


if __name__ == "__main__":
    main()

"""``rlvr-lightning fit|validate|test|predict`` through LightningCLI, ``push`` (Hub upload) and
``export`` (a checkpoint to a ``from_pretrained`` folder).

Every Trainer gets ``checkpointing.AtomicCheckpointIO`` (unless another CheckpointIO plugin is
configured), a ``checkpointing.CheckpointGuard`` and the ``watchers`` (``MemoryGuard``,
``CollectiveWatch``) unless configured; its ``log_every_n_steps`` defaults to 1
(``LOG_EVERY_N_STEPS``), and ``fit`` adds a ``CompletionsTable`` unless one is configured or
``--log_completions=false``. Exit codes: 0 done, 1 error, 2 bad
arguments or config, 130 stopped by SIGINT, 143 stopped by SIGTERM (128 + signal number, after
the on-exception checkpoints). Errors are summarised in a few lines (``cli_errors``);
``RLVR_TRACEBACK=1`` shows the full traceback.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from argparse import ArgumentError
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    Callback,
    ProgressBar,
)
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torchmetrics import Metric

from rlvr_lightning.callbacks import PredictionWriter, StepProgressBar
from rlvr_lightning.callbacks.memory_guard import MemoryLimitExceeded, exit_at_once
from rlvr_lightning.cli import errors as cli_errors
from rlvr_lightning.cli.help import KeysFirstFormatter, subcommand_kwargs
from rlvr_lightning.cli.overview import COMMANDS, TRAINER_COMMANDS, print_overview
from rlvr_lightning.cli.watchers import COMPLETIONS_ROWS, with_completions_table, with_watchers
from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.device import measured_precision
from rlvr_lightning.module import RLVRModule
from rlvr_lightning.options import GROUPS
from rlvr_lightning.runtime import checkpoint_files, checkpointing

LOG_EVERY_N_STEPS = 1  # the CLI's trainer default: train/* metrics every step


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
        parser.add_argument(
            "--choose_precision",
            type=bool,
            default=False,
            help="time the update's products in fp32 and bf16 on the policy's shapes and set "
            "trainer.precision to the faster one that agrees (bf16-mixed or 32-true), once per "
            "machine (cached); the choice is logged and on the model card's hardware line.",
        )
        parser.add_argument(
            "--log_completions",
            type=bool,
            default=True,
            help="fit only: add a CompletionsTable (every step, "
            f"{COMPLETIONS_ROWS} rows, completions.jsonl beside the metrics) unless one is "
            "configured; false: none.",
        )

    def add_core_arguments_to_parser(self, parser: Any) -> None:
        # LightningCLI's order with the Trainer last: `fit --help` shows the model and data
        # before the Trainer's ~60 flags (cli.help).
        model, data = self.subclass_mode_model, self.subclass_mode_data
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=model)
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=data)
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        defaults = {f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"}
        parser.set_defaults(defaults)

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
        if self._setting("choose_precision"):
            config["precision"] = measured_precision(self.model.policy)
            rank_zero_info(f"choose_precision: trainer.precision={config['precision']} (measured)")
        callbacks = with_step_progress(config, checkpointing.with_guard(callbacks))
        callbacks = with_watchers(config, callbacks)  # MemoryGuard, CollectiveWatch
        if self.subcommand == "predict":
            callbacks = with_prediction_writer(config, callbacks)
        if self.subcommand == "fit" and self.config["fit"].get("log_completions", True):
            callbacks = with_completions_table(config, callbacks)
        return super()._instantiate_trainer(config, callbacks)

    def _evaluate(self) -> dict[str, float]:
        results = self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
        reset_metric_states(self.model)
        # One dict per validation loader (RLVRDataModule: val, then val asked in other words).
        return {k: float(v) for result in results for k, v in result.items()}

    def fit(self, model: RLVRModule, **kwargs: Any) -> None:
        # `ckpt_path: last` is meant to be set once and kept ("resume if there is one"); on the
        # first run Lightning warns that there is none, so say it once, calmly, instead.
        # "last" is the last*.ckpt with the highest step (Lightning: the newest file time).
        if kwargs.get("ckpt_path") == "last":
            kwargs["ckpt_path"] = checkpoint_files.resolve_last(self.trainer)
            if kwargs["ckpt_path"] is None:
                rank_zero_info("ckpt_path=last: no checkpoint yet, training starts from step 0.")
        self.trainer.fit(model, **kwargs)

    def before_fit(self) -> None:
        self._before = self._evaluate() if self._setting("evaluate_before_after") else None

    def after_fit(self) -> None:
        if self._before is None or self.trainer.interrupted:
            return
        after = self._evaluate()
        print("\nValidation before -> after training")
        for key in sorted(set(self._before) | set(after)):
            b, a = self._before.get(key, float("nan")), after.get(key, float("nan"))
            print(f"  {key:<24} {b:8.4f} -> {a:8.4f}  ({a - b:+.4f})")

    def _setting(self, name: str) -> bool:
        """A top-level flag of this CLI (under the subcommand when there is one)."""
        config = self.config.get(self.subcommand, {}) if self.subcommand else self.config
        return bool(config.get(name, False))


def with_step_progress(config: dict[str, Any], callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` plus a ``StepProgressBar`` where Lightning would add its default bar (which
    reads ``Epoch 0/-2`` under ``max_steps``): the bar is on and none is configured."""
    given = config.get("callbacks") or []
    configured = [*(given if isinstance(given, list) else [given]), *callbacks]
    if config.get("enable_progress_bar") is False or any(
        isinstance(cb, ProgressBar) for cb in configured
    ):
        return callbacks
    return [*callbacks, StepProgressBar()]


def with_prediction_writer(config: dict[str, Any], callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` plus a ``PredictionWriter`` to ``<default_root_dir>/predictions.jsonl``
    unless a prediction writer is configured: ``predict`` always leaves a file behind."""
    given = config.get("callbacks") or []
    configured = [*(given if isinstance(given, list) else [given]), *callbacks]
    if any(isinstance(cb, (BasePredictionWriter, PredictionWriter)) for cb in configured):
        return callbacks
    root = config.get("default_root_dir") or os.getcwd()
    return [*callbacks, PredictionWriter(os.path.join(root, "predictions.jsonl"))]


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


_EPILOG = "Other commands: push, export (`rlvr-lightning --help` describes every command)."


_NULL_FIELD = re.compile(r"--model\.(?:init_args\.)?(\w+)\.(\w+)=(?:null|None|none|~)")


def nulls_as_mappings(args: list[str]) -> list[str]:
    """``--model.init_args.update.grad_clip=null`` as ``--model.init_args.update={grad_clip:
    null}``: jsonargparse reads a dotted null inside a subclass's dataclass argument as the
    string ``"None"`` and rejects it, while the mapping form sets it (other fields keep their
    values)."""
    out = []
    for arg in args:
        match = _NULL_FIELD.fullmatch(arg)
        if match and match.group(1) in GROUPS:
            arg = f"--model.init_args.{match.group(1)}={{{match.group(2)}: null}}"
        out.append(arg)
    return out


def build_cli(
    args: list[str] | None = None, run: bool = True, exit_on_error: bool = True
) -> RLVRCLI:
    """Parse ``args`` (default: ``sys.argv``) and run the subcommand; returns the CLI object.

    ``exit_on_error=False`` raises parse errors (``argparse.ArgumentError``) instead of printing
    the usage and exiting, so ``main`` can report them in its own format.
    """
    parser_kwargs: dict[str, Any] = {
        s: {
            "exit_on_error": exit_on_error,
            **subcommand_kwargs(COMMANDS[s], RLVRModule, RLVRDataModule),
        }
        for s in TRAINER_COMMANDS
    }
    from_argv = args is None
    rewritten: list[str] | None = nulls_as_mappings(sys.argv[1:] if from_argv else args)
    if from_argv and rewritten == sys.argv[1:]:
        rewritten = None  # Lightning reads sys.argv itself
    with warnings.catch_warnings():
        if from_argv and rewritten is not None:  # its warning would only describe our rewrite
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return RLVRCLI(
            RLVRModule,
            RLVRDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=rewritten,
            run=run,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={
                "exit_on_error": exit_on_error,
                "epilog": _EPILOG,
                "formatter_class": KeysFirstFormatter,  # jsonargparse gives it to the subcommands
                **parser_kwargs,
            },
            # Train metrics from the first step: Lightning's default (50) hides a short run's
            # first 49 steps. A config's own `trainer.log_every_n_steps` still wins.
            trainer_defaults={"log_every_n_steps": LOG_EVERY_N_STEPS},
            # The module steps its own AdamW + warm-up (manual optimisation); Lightning's
            # --optimizer/--lr_scheduler would replace it and ignore the `update` options.
            auto_configure_optimizers=False,
        )


def _import_from_cwd() -> None:
    # `python -m rlvr_lightning.cli.main` puts the working directory first on sys.path; the console
    # script puts its bin folder there instead. Do what `python -m` does, so a config's
    # `rewards: {functions: [my_rewards.fn]}`
    # imports `my_rewards.py` from the folder the user runs in.
    cwd = os.getcwd()
    if not any(p in ("", cwd) for p in sys.path):
        sys.path.insert(0, cwd)


def _dispatch(argv: list[str], from_sys_argv: bool) -> None:
    if argv[:1] == ["push"]:  # not Trainer subcommands: handled before LightningCLI parses
        from rlvr_lightning.cli.push import push_command

        push_command(argv[1:])
    elif argv[:1] == ["export"]:
        from rlvr_lightning.cli.push import export_command

        export_command(argv[1:])
    else:
        build_cli(None if from_sys_argv else argv, exit_on_error=False)


def _drop_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip:")


def silence_library_noise() -> None:
    """Mute what the libraries print on every normal run and the user can do nothing about:
    Lightning's advert for its cloud logger (logged at INFO each time loggers are set up),
    the FutureWarning Lightning's ``CombinedLoader`` triggers in torch >= 2.13's pytree
    (``isinstance(treespec, LeafSpec)``), and ModelCheckpoint's 20-line example about saving
    pre-optimisation state under manual optimisation (this module checkpoints at step
    boundaries, after the optimiser step, on purpose), and the model summary's note that it
    cannot size parameters under ``bf16-mixed`` (they are fp32 master weights; the size it
    prints is right). Idempotent."""
    tip_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if _drop_tip not in tip_logger.filters:
        tip_logger.addFilter(_drop_tip)
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
    )
    warnings.filterwarnings(
        "ignore", message=r"Using ModelCheckpoint with manual optimization and every_n_train_steps"
    )
    warnings.filterwarnings("ignore", message=r"Precision .* is not supported by the model summary")


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``rlvr-lightning`` command; ``args`` makes it callable from tests
    (which then leave ``sys.path`` alone: only the command line imports from the cwd)."""
    if args is None:
        _import_from_cwd()
    argv = sys.argv[1:] if args is None else list(args)
    if print_overview(argv):
        raise SystemExit(0 if argv else 2)
    silence_library_noise()
    try:
        _dispatch(argv, from_sys_argv=args is None)
    except SIGTERMException as stop:  # Lightning's own SIGTERM stop exits 0 otherwise
        raise SystemExit(143) from stop
    except MemoryLimitExceeded:  # checkpoint and message are out; a thread may still allocate
        if args is None:
            exit_at_once(1)
        raise
    except Exception as err:
        if cli_errors.traceback_requested():
            raise
        named = [a for a in argv if a in tuple(COMMANDS)]
        command = " ".join(["rlvr-lightning", *named[:1]])
        print(cli_errors.summary(err, command), file=sys.stderr)
        raise SystemExit(2 if isinstance(err, ArgumentError) else 1) from None


if __name__ == "__main__":
    main()

"""``rlvr-lightning push <export-folder | checkpoint.ckpt> --repo-id org/name`` and
``rlvr-lightning export <checkpoint.ckpt>``.

An export folder (from ``ExportModel`` / ``PushToHub``) is uploaded as it is. A Lightning
checkpoint is first exported next to it (``<name>-export/``, or ``--export-dir``) with a model
card rebuilt from what the checkpoint holds, then uploaded. The token comes from ``HF_TOKEN`` or
the ``huggingface_hub`` login. ``export`` does the export step alone, without uploading.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlvr_lightning.hub import model_card
from rlvr_lightning.hub.card_safety import adapter_base_model
from rlvr_lightning.hub.transfer import export_pretrained, module_heads, push_folder


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlvr-lightning push",
        description="Upload an exported model folder, or a checkpoint (exported first), to the "
        "Hugging Face Hub. The token comes from HF_TOKEN or `hf auth login`.",
    )
    parser.add_argument("path", help="an export folder or a Lightning .ckpt file")
    parser.add_argument("--repo-id", required=True, help="the Hub repository, org/name")
    parser.add_argument("--revision", default=None, help="target branch (default: main)")
    parser.add_argument("--public", action="store_true", help="create the repository public")
    parser.add_argument("--commit-message", default="Upload model trained with rlvr-lightning")
    parser.add_argument("--retries", type=int, default=3, help="retries with backoff")
    parser.add_argument("--endpoint", default=None, help="Hub URL (default: HF_ENDPOINT)")
    parser.add_argument("--export-dir", default=None, help="checkpoints: where to export")
    parser.add_argument("--adapter-only", action="store_true", help="checkpoints: LoRA adapter")
    _card_options(parser)
    return parser


def _card_options(parser: argparse.ArgumentParser) -> None:
    """The options both commands take: the card, the adapter's base, the module's code."""
    parser.add_argument("--card-template", default="default", help="card template name or path")
    parser.add_argument("--license", default="apache-2.0", help="license in the card metadata")
    parser.add_argument(
        "--base-model",
        default=None,
        help="adapter-only: the base model the adapter records (a Hub id; default: the "
        "policy's Hub id, else its local folder, which resolves on this machine only)",
    )
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (a module in the folder you run from, or a .py file) before "
        "loading: the module subclass, loss or reward functions a checkpoint names",
    )


def import_user_modules(names: Sequence[str]) -> None:
    """Import each of ``names``: a ``.py`` file (under its stem's name) or a module importable
    from the working directory (as ``python -m`` would), so that a checkpoint's own classes and
    functions resolve. Lightning loads a subclass only once its module is imported."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    for name in names:
        path = Path(name)
        if path.suffix == ".py":
            if not path.is_file():
                raise SystemExit(f"--import {name}: no such file.")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module  # the checkpoint names it `<stem>.<Class>`
            spec.loader.exec_module(module)
        else:
            importlib.import_module(name)


def check_module_class(hparams: Mapping[str, Any]) -> None:
    """Raise, with the ``--import`` to add, when the checkpoint was written by a subclass of
    ``RLVRModule`` (LightningCLI's ``_class_path``) whose module is not imported."""
    class_path = str(hparams.get("_class_path") or "")
    module = class_path.rpartition(".")[0]
    if module and module not in sys.modules:
        raise SystemExit(
            f"The checkpoint was written by {class_path}, a module class that is not imported. "
            f"If you trust the checkpoint, add `--import {module}` ({module}.py in the folder "
            f"you run from, or its path: `--import path/to/{module.split('.')[-1]}.py`)."
        )


def build_export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlvr-lightning export",
        description="Write a Lightning checkpoint as a from_pretrained folder (weights, "
        "tokenizer, model card) without uploading it.",
    )
    parser.add_argument("ckpt", help="a Lightning .ckpt file")
    parser.add_argument("--output", default=None, help="target folder (default: <name>-export)")
    parser.add_argument("--repo-id", default=None, help="the Hub name the card's usage shows")
    parser.add_argument("--adapter-only", action="store_true", help="LoRA: the adapter alone")
    _card_options(parser)
    return parser


def _record_in(checkpoint: Mapping[str, Any]) -> model_card.TrainingRecord:
    # ExportModel and PushToHub keep their TrainingRecord in the checkpoint's callback states.
    for state in checkpoint.get("callbacks", {}).values():
        if isinstance(state, Mapping) and "record" in state:
            return model_card.record_from_dict(state["record"])
    return model_card.TrainingRecord()


def export_checkpoint(
    ckpt: str | Path,
    target: str | Path,
    *,
    repo_id: str | None = None,
    adapter_only: bool = False,
    card_template: str = "default",
    license: str = "apache-2.0",
    base_model: str | None = None,
) -> Path:
    """Rebuild the module from ``ckpt`` and export it with a card to ``target``; an
    adapter-only export records ``base_model`` (default: ``adapter_base_model``'s choice)."""
    import torch

    from rlvr_lightning.callbacks.export_model import CARD_FILE, CURVE_FILE
    from rlvr_lightning.module import RLVRModule
    from rlvr_lightning.options import GROUPS, regroup

    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    # A checkpoint from before the option groups keeps its settings: its top-level keys are
    # moved into their groups (the flat ones are then ignored as unknown arguments).
    check_module_class(checkpoint.get("hyper_parameters", {}))
    groups = regroup(checkpoint.get("hyper_parameters", {}))
    groups = {k: v for k, v in groups.items() if k in GROUPS}
    module = RLVRModule.load_from_checkpoint(ckpt, map_location="cpu", **groups)
    policy = str(module.hparams.get("policy", ""))
    base = adapter_base_model(policy, base_model) if adapter_only else None
    path = export_pretrained(
        module.policy,
        module.tokenizer,
        target,
        adapter_only=adapter_only,
        heads=module_heads(module),
        base_model=base,
    )
    record = _record_in(checkpoint)
    curve = None
    if record.steps:
        model_card.reward_curve_png(record.steps, record.rewards, path / CURVE_FILE)
        curve = CURVE_FILE
    context = model_card.card_context(
        model_card.checkpoint_facts(checkpoint, module),
        record,
        repo_id=repo_id,
        license=license,
        adapter_only=adapter_only,
        reward_curve=curve,
        base_model=base_model,
    )
    text = model_card.render_card(context, card_template)
    (path / CARD_FILE).write_text(model_card.scrub(text, [path.resolve(), Path(ckpt).parent]))
    return path


def push_command(argv: Sequence[str]) -> str:
    """Run ``push`` with ``argv`` (the arguments after ``push``); returns the commit URL."""
    args = build_parser().parse_args(list(argv))
    import_user_modules(args.imports)
    source = Path(args.path)
    if source.is_file() and source.suffix == ".ckpt":
        target = Path(args.export_dir or source.with_name(f"{source.stem}-export"))
        folder = export_checkpoint(
            source,
            target,
            repo_id=args.repo_id,
            adapter_only=args.adapter_only,
            card_template=args.card_template,
            license=args.license,
            base_model=args.base_model,
        )
        print(f"Exported {source.name} to {folder}")
    elif source.is_dir():
        folder = source
    else:
        raise SystemExit(f"push: {args.path!r} is neither an export folder nor a .ckpt file.")
    url = push_folder(
        folder,
        args.repo_id,
        revision=args.revision,
        private=not args.public,
        commit_message=args.commit_message,
        endpoint=args.endpoint,
        attempts=args.retries + 1,
    )
    print(f"Pushed {folder} to {url}")
    return url


def export_command(argv: Sequence[str]) -> Path:
    """Run ``export`` with ``argv`` (the arguments after ``export``); returns the folder."""
    args = build_export_parser().parse_args(list(argv))
    import_user_modules(args.imports)
    source = Path(args.ckpt)
    if not source.is_file():
        raise SystemExit(f"export: checkpoint {args.ckpt!r} does not exist.")
    folder = export_checkpoint(
        source,
        Path(args.output or source.with_name(f"{source.stem}-export")),
        repo_id=args.repo_id,
        adapter_only=args.adapter_only,
        card_template=args.card_template,
        license=args.license,
        base_model=args.base_model,
    )
    print(f"Exported {source.name} to {folder}")
    return folder

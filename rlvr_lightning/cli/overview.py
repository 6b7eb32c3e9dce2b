"""The commands and the overview help, without importing torch.

``COMMANDS`` is what ``rlvr-lightning --help`` prints (``command.main``) and where the
subcommands' own ``--help`` descriptions come from (``cli.main``), so the two cannot drift.
"""

from __future__ import annotations

import sys
import textwrap

COMMANDS = {
    "fit": (
        "Train. `--config FILE` (start from configs/quickstart.yaml or configs/tiny.yaml); the "
        "model and data keys are listed by `rlvr-lightning fit --model.help RLVRModule` and "
        "`--data.help RLVRDataModule`; `--print_config` prints a whole config as YAML."
    ),
    "validate": "Evaluate on the validation prompts (logged as val/*), e.g. with --ckpt_path.",
    "test": (
        "Evaluate on the test set (logged as test/*): data.test_source, or the data.test_split "
        "(default: test) of Hub and repository-folder sources."
    ),
    "predict": (
        "Sample val_sampling.group_size completions per prompt (data.predict_on: val or test) and "
        "write them with every reward and per-prompt pass@k to "
        "<default_root_dir>/predictions.jsonl (or the path of a configured PredictionWriter)."
    ),
    "push": (
        "`rlvr-lightning push PATH --repo-id org/name`: upload an export folder or a checkpoint "
        "to the Hugging Face Hub with its model card."
    ),
    "export": (
        "`rlvr-lightning export CKPT`: write a checkpoint as a from_pretrained folder with its "
        "model card."
    ),
}
TRAINER_COMMANDS = ("fit", "validate", "test", "predict")

_HELP_FLAGS = ([], ["-h"], ["--help"])


def overview() -> str:
    """The text of ``rlvr-lightning --help``."""
    lines = [
        "usage: rlvr-lightning COMMAND [options]",
        "",
        "Reinforcement learning with verifiable rewards on PyTorch Lightning.",
        "",
        "commands (each with --help for its options):",
    ]
    for name, text in COMMANDS.items():
        wrapped = textwrap.wrap(
            text, width=88, initial_indent=f"  {name:<10}", subsequent_indent=" " * 12
        )
        lines.extend(wrapped)
    lines += ["", "Errors print their cause and fix; RLVR_TRACEBACK=1 shows the full traceback."]
    return "\n".join(lines)


def print_overview(argv: list[str]) -> bool:
    """Print the overview for a bare command or ``-h`` / ``--help``; whether it did.

    A bare ``rlvr-lightning`` is a usage error (exit code 2 from ``main``), so the overview goes
    to stderr there and to stdout when asked for.
    """
    if argv not in _HELP_FLAGS:
        return False
    print(overview(), file=sys.stdout if argv else sys.stderr)
    return True

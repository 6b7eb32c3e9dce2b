"""The ``rlvr-lightning`` command's front door: the overview help without importing torch.

``rlvr-lightning``, ``-h`` and ``--help`` print the commands (``cli.overview``) in well under a
second; anything else goes to ``rlvr_lightning.cli.main`` (LightningCLI and the Hub commands),
which imports the trainer.
"""

from __future__ import annotations

import sys

from rlvr_lightning.cli.overview import print_overview


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``rlvr-lightning`` console script."""
    argv = sys.argv[1:] if args is None else list(args)
    if print_overview(argv):
        raise SystemExit(0 if argv else 2)
    from rlvr_lightning.cli.main import main as run

    run(args)


if __name__ == "__main__":
    main()

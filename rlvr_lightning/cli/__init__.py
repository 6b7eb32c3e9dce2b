"""The command line: the ``rlvr-lightning`` entry (``command``: help without importing torch),
the LightningCLI subclass (``main``), errors as cause and fix (``errors``) and the ``push`` /
``export`` commands (``push``). The top layer: may import everything, nothing imports it.
"""

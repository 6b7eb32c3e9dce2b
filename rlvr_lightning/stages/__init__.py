"""The stages of a training step and the module's building blocks around them.

Generation, dynamic sampling, ``π_old``, off-policy rows, the policy update and the optimiser
steps, the step summary, the hook points (``hooks``), the constructor's builders (``build``)
and the lifecycle around the step. Stages take data (the batch types, the models, plain
options), never ``RLVRModule``. May import every package below it: ``types``, ``options``,
``algorithms``, ``device``, ``runtime``, ``hub``, ``rewards``, ``models``, ``heads``,
``data``, ``rollout``.
"""

"""Sources of off-policy rows for guidance callbacks: a teacher model, a guide checkpoint, the
run's own experience pool (ExGRPO), and the look-ahead that trains a few steps ahead (NPO).

May import the stages and everything below them; never the module or callbacks.
"""

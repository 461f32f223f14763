"""The exit code a rank and its supervisor agree on. No MLX here: the supervisor
(``k3dist.serve.supervise``, ``launch/run.py``) reads it without loading MLX."""

# a rank that exits because a peer was lost (k3dist.serve.watchdog)
LOST_EXIT_CODE = 3

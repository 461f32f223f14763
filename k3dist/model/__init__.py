"""Model layer: the expert-parallel Kimi K3 on mlx-lm's own ``kimi_k3``.

Only the routed experts and their collective are swapped (one bank, ``ep``; two banks,
``two_bank``), attention is split through mlx-lm's own ``shard()`` (``attention``), MoE
forms and prefill chunking (``forms``), the private mlx-lm names k3dist relies on
(``compat``), and joining the group within a bound (``group``). Imports only
``k3dist.format``, mlx, mlx-lm and numpy: serving and building both run it."""

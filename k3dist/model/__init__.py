"""The expert-parallel Kimi K3: mlx-lm's ``kimi_k3`` with only the routed experts and
their collective swapped (one bank, ``ep``; two banks, ``two_bank``), attention split
through mlx-lm's own ``shard()`` (``attention``), MoE forms and prefill chunking
(``forms``), the private mlx-lm names k3dist relies on (``compat``), and joining the
group within a bound (``group``). Imports only
``k3dist.format``, mlx, mlx-lm and numpy: serving and building both run it."""

"""Pipeline layer: a Moonshot checkpoint to per-rank folders ready to serve.

Audit (``audit``, ``checkpoint``, ``mlxbuild``), convert (``convert``), teacher and
calibration (``calibtext``, ``teacher``, ``calibrate``, ``stream``, ``student``), the
byte budget (``byte_budget``, its command ``plan``), graded builds (``promote``,
``profiles``, ``direct``), DWQ (``dwq``, ``expert_grad``, ``adam``), slicing
(``slicing``, ``rank_files``), the embedded default (``default``) and the one resumable
command over all of it (``runner``, its ``stage_graph`` and ``diskplan``). Imports
format, config and model, never serving."""

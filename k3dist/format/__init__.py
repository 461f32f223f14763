"""Format layer: the bytes on disk and the arithmetic over them.

Safetensors headers and streams (``sfile``, ``source``), the tensor layout a config
implies (``layout``, ``classes``), quantization formats and their byte math (``qformat``,
``mxfp4``, ``graded``), placement (with the MoE forms and the group-join bound that the
model and the config layer both read), tokens, one manifest schema and its verification
(``manifest``, ``verify``), one journaled output folder (``journal``, ``folder``), KV and
state arithmetic (``kvmemory``). Imports mlx, numpy and the standard library only: no
configuration (pydantic, yaml) lives here."""

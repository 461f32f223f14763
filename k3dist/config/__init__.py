"""Config layer: what a deployment and a box are, read at the edge and passed down.

The deployment schema (one typed definition that makes the flags and reads the YAML,
``deployment``) and the box description (memory, wired limit, reserve, bandwidth:
``box``) that the planner, the cost model and serving share. Imports ``k3dist.format``,
pydantic and yaml (nothing of ``k3dist.model``: the two sit side by side); nothing is read
at import."""

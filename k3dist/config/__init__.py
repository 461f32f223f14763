"""Config layer: what a deployment and a box are, read at the edge and passed down.

The deployment schema (one typed definition that makes the flags and reads the YAML,
``deployment``) and the box description (memory, wired limit, reserve, bandwidth:
``box``) that the planner, the cost model and serving share. Imports ``k3dist.format``,
``k3dist.model``'s constants, pydantic and yaml; nothing is read at import."""

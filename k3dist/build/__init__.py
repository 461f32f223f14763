"""Build pipeline: audit a source checkpoint, convert it to an MLX build, slice it per rank."""

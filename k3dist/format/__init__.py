"""Format layer: safetensors files, the layout a config implies, MXFP4, placement, tokens."""

"""k3dist: Kimi K3 across Apple Silicon Macs with MLX expert parallelism."""

from pathlib import Path

from k3dist._blas import blas_status, preload
from k3dist._blas import set_threads as set_blas_threads

# Must run before anything imports mlx.core (see _blas.py).
preload()

__version__ = "0.1.0"
# the repository (an editable install's checkout) and its data/: the shipped mini-K3, its
# corpus and tokenizer (data/README.md)
REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "data"
__all__ = ["__version__", "blas_status", "set_blas_threads"]

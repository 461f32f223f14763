"""k3dist: Kimi K3 across Apple Silicon Macs with MLX expert parallelism."""

from importlib import resources
from pathlib import Path

from k3dist._blas import blas_status, preload
from k3dist._blas import set_threads as set_blas_threads

# Must run before anything imports mlx.core (see _blas.py).
preload()

__version__ = "0.1.0"
# the repository (an editable install's checkout) and its data/: what the mini-K3 is
# trained on, its corpus and tokenizer (data/README.md); not installed
REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "data"
# what ships inside the package (pip install . too): the embedded default's source (the
# trained mini-K3, Moonshot's format) and the real K3's config and tensor index
PACKAGE_DATA = Path(str(resources.files(__name__).joinpath("data")))
MINI_K3 = PACKAGE_DATA / "mini-k3"
__all__ = ["__version__", "blas_status", "set_blas_threads"]

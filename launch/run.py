"""Run a script on every rank through mlx.launch, supervised (k3dist.serve.supervise).

    .venv/bin/python launch/run.py --hostfile hostfiles/local.json -- launch/serve.py
    .venv/bin/python launch/run.py --hostfile hostfiles/tb5.json -- launch/serve.py \\
        --config deploy/tb5.yaml

Options and exit codes: k3dist.serve.launch (``launch/run.py --help``).
"""

import sys

from k3dist.serve import launch

if __name__ == "__main__":
    sys.exit(launch.main())

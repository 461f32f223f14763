"""Serve Kimi K3 expert-parallel over an OpenAI-compatible API (rank 0 answers).

    mlx.launch --hostfile hostfiles/tb5.json launch/serve.py [--config deploy.yaml]
    mlx.launch --hostfile hostfiles/local.json --python .venv/bin/python launch/serve.py

The start-up itself is k3dist.serve.rank's (watchdog, preflight, load, warm-up, serve).
"""

from k3dist.serve import rank

if __name__ == "__main__":
    rank.main()

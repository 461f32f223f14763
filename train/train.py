"""Train the mini-K3 (issue 6) on the committed corpus, then freeze and export it.

    python train/train.py --out runs/train --max-minutes 50     # pretrain (resumable)
    mlx.launch -n 2 --python .venv/bin/python train/train.py --out runs/train --max-minutes 50
                                                              # the same, data-parallel
    python train/train.py --out runs/train --freeze --minutes 10  # experts -> MXFP4, fine-tune
    python train/train.py --out runs/train --export k3dist/data/mini-k3  # Moonshot source format
    python train/train.py --out runs/train --plot runs/train/curve.png
    python train/train.py --out runs/more --size sparse --seed 1 --init data/mini-k3-sparse \
        --max-minutes 55                                          # warm start from an export
    python train/train.py chat --out data/mini-k3-chat --steps 40  # the chat stage

Sizes, schedule and the run folder's files: ``k3dist/factory/train.py``; measured speeds
and the recommended run: ``train/README.md``. Measure a size first:
``python -m k3dist.factory.train speed --size m --seq 256 --batch 8``.
"""

import sys

import k3dist  # noqa: F401  (loads OpenBLAS before mlx)
from k3dist.factory import chat_train, train

if __name__ == "__main__":
    if sys.argv[1:2] == ["chat"]:  # the chat stage (issue 41): k3dist/factory/chat_train.py
        chat_train.main(sys.argv[2:], prog="python train/train.py chat")
    else:
        train.main()

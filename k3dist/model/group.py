"""Joining the ``mx.distributed`` group, retried within a bound.

MLX's ring backend gives up on a peer that is not yet listening about 30 s after its
first try (five connects, doubling waits) and raises; the listening side waits with no
bound. A rank that reaches ``init`` late (a slow import on a loaded machine, a second
Mac that boots its Python later) therefore failed the whole start. Joining again in the
same process works once the peer listens, so each entry point joins through
:func:`join`, which tries again until ``connect_s`` has passed and then raises with
the bound and the fix. One process (no hostfile) joins at once."""

from __future__ import annotations

import json
import os
import sys
import time

from k3dist.format.placement import RING_CONNECT_S

import mlx.core as mx


class GroupJoinError(RuntimeError):
    """The group could not be joined within the bound."""


def join(connect_s: float = RING_CONNECT_S, *, log=None) -> mx.distributed.Group:
    """The global group, joined; retried on the backend's connect failure until
    ``connect_s`` seconds (the deployment's ``ring_connect_s``) have passed
    since the first try. A try itself may take ~30 s on the ring backend, so the bound
    can be overrun by one try."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    start = time.monotonic()
    tries = 0
    while True:
        tries += 1
        try:
            return mx.distributed.init()
        except RuntimeError as e:
            waited = time.monotonic() - start
            if waited >= connect_s:
                raise GroupJoinError(
                    f"could not join the distributed group in {waited:.0f} s ({tries} "
                    f"tries; last: {e}): check that every rank was started and that the "
                    "hostfile's addresses reach each other, or raise ring_connect_s "
                    "(--ring-connect-s)"
                ) from e
            log(f"[k3dist] joining the group: {e}; trying again ({waited:.0f} s of {connect_s:g})")


def report(record: dict) -> None:
    """Print ``record`` as one JSON line on stdout in a single ``write``. mlx.launch relays
    each rank's output in the pieces it reads, so a line written in two (``print``'s
    text, then its newline, as under ``PYTHONUNBUFFERED``) can get another rank's line
    between them, and a reader of the merged output sees two records on one line. One
    write puts the whole line in the pipe at once, so the relay reads it whole (while a
    rank has less than the relay's 8 KB read waiting, as a report at the end does)."""
    sys.stdout.flush()  # what was printed before goes first
    data = (json.dumps(record) + "\n").encode()
    while data:
        data = data[os.write(sys.stdout.fileno(), data) :]

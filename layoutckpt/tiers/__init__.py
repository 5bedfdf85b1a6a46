"""Multi-tier checkpoints: every save commits to a fast tier (host memory or a node-local
directory) on each rank, and an ordinary checkpoint is persisted to the durable tier in the
background every few steps; a restart restores the newest step some tier holds for every rank.

``_stage`` copies a rank's state into host buffers, ``_local`` stores it as that rank's piece
(an ordinary checkpoint of its own shards), ``_saver`` runs the saves, replicas and persists,
``_restore`` makes every rank agree on what to restore and reads a piece back. ``CheckpointManager(local=...)`` is the
entry point (``docs/design/multi-tier.md`` says why it is built this way).
"""

from ._local import TIER_KEY, LocalTier, layout_key
from ._restore import Choice, agree, fetch_missing, load_piece, piece_misfit
from ._saver import TierMetrics, Tiers

__all__ = [
    "TIER_KEY",
    "Choice",
    "LocalTier",
    "TierMetrics",
    "Tiers",
    "agree",
    "fetch_missing",
    "layout_key",
    "load_piece",
    "piece_misfit",
]

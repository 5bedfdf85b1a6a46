"""Bytes this process has read from local checkpoint files, counted where the reads are made."""

from __future__ import annotations

import tensorstore as ts

from layoutckpt.storage import _shardread

TENSORSTORE_COUNTER = "/tensorstore/kvstore/file/bytes_read"


def bytes_read() -> int:
    """TensorStore's file-kvstore counter plus layoutckpt's own shard-file reader's
    (``_shardread.read_box``, which loads of local checkpoints use)."""
    total = _shardread.bytes_read()
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/"):
        if metric["name"] == TENSORSTORE_COUNTER:
            total += int(sum(v.get("value", 0) for v in metric["values"]))
    return total

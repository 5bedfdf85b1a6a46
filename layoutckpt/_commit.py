"""The end of every save: commit only if every rank wrote its part, on every rank alike.

``save`` and ``import_dcp`` both end here. The ranks agree on success (one all-reduce), rank 0
commits (``Location.commit``: the root document last), and every rank learns the outcome; a
rank that loses rank 0 after the ranks agreed looks at the destination instead. A rank lost
before that is named in the error of every rank still alive (``RankLostError``).
"""

from __future__ import annotations

from .base import _faults
from .base._errors import SaveError
from .format._format import CheckpointMeta, root_document
from .storage import _packs
from .storage._location import Location
from .torch._dist import Comm, StoreComm, raise_named


def commit_everywhere(
    comm: Comm | StoreComm, tmp: Location, final: Location, meta: CheckpointMeta, failure: bytes, overwrite: bool
) -> None:
    """Commit only if every rank wrote all it had to; otherwise remove the partial data. Every
    writer of a checkpoint (``save``, ``import_dcp``) ends with it, so all commit alike."""
    _faults.point("save.agree", rank=comm.rank)
    comm = comm.during("before the save's ranks agreed to commit it (nothing was committed)")
    try:
        (failed,) = comm.all_reduce([1 if failure else 0], "max")
    except BaseException:
        if comm.rank == 0:
            _discard_quietly(tmp)  # a rank is missing: no rank has agreed, nothing will commit
        raise
    if failed:
        messages = comm.all_gather_bytes(failure)
        if comm.rank == 0:
            tmp.discard()
        comm.barrier()
        comm.finish()
        detail = "; ".join(f"rank {r}: {m.decode()}" for r, m in enumerate(messages) if m)
        raise SaveError(f"saving {final.url!r} failed, nothing was committed: {detail}")
    _faults.point("save.agreed", rank=comm.rank, staging=tmp.url, final=final.url)
    status = b""
    if comm.rank == 0:
        try:
            if meta.packed:  # one database of the ranks' (``storage._packs``), durable before the marker
                _packs.merge(tmp, comm.world)
                tmp.make_durable()
            # Every rank made its part durable before it reported success (in ``_write``).
            final.commit(tmp, root_document(meta), overwrite=overwrite, save_id=meta.save_id)
        except Exception as err:  # noqa: BLE001 - broadcast to every rank below
            _discard_quietly(tmp)  # even where this fails too, the others must hear the outcome
            status = f"{type(err).__name__}: {err}".encode()
    try:
        status = comm.unnamed().broadcast_bytes(status if comm.rank == 0 else None)
    except Exception as err:  # noqa: BLE001 - re-raised, named, unless the save is in place
        # Rank 0 knows its own outcome; another rank that cannot hear it looks at the path, and
        # only where the save is not in place spends the seconds it takes to name the ranks lost.
        if comm.rank != 0 and not _committed_by_this_save(tmp, final, overwrite):
            raise_named(comm.during("before rank 0 told the others whether it committed the save"), err, "broadcast")
    comm.finish()
    if status:
        raise SaveError(f"committing {final.url!r} failed on rank 0: {status.decode()}")
    _faults.point("save.committed", rank=comm.rank, final=final.url)


def _discard_quietly(tmp: Location) -> None:
    try:
        tmp.discard()
    except Exception:  # noqa: BLE001 - a leftover the next manager start (or the next save) removes
        pass


def _committed_by_this_save(tmp: Location, final: Location, overwrite: bool) -> bool:
    """Whether ``final`` holds the checkpoint this save committed, for a rank that lost rank 0
    after the ranks agreed. Without ``overwrite`` the destination held no committed checkpoint
    when the save began, so one there now is this save's; a local save's staging directory is
    then gone (renamed into place). With ``overwrite`` the old checkpoint may still be there."""
    try:
        return not overwrite and final.committed() and not (final.is_local and tmp.exists())
    except Exception:  # noqa: BLE001 - unknowable here: the broadcast's error stands
        return False

"""The exceptions layoutckpt raises.

Each subclasses the standard exception a caller would already catch (``ValueError`` for bad
input, ``FileNotFoundError`` for a missing checkpoint), so generic handlers keep working, and
each message names the array, what was expected, and how to fix it.
"""

from __future__ import annotations

from collections.abc import Iterable


class LayoutError(ValueError):
    """A mesh, spec or layout rule does not fit the arrays it is applied to."""


class InconsistentShardsError(LayoutError):
    """Ranks disagree about an array: its local shard shapes, dtype, or the set of names."""


class WorldSizeError(LayoutError):
    """The mesh has a different number of devices than the process group has ranks."""


class InvalidNameError(ValueError):
    """A global array name cannot be mapped to a safe storage path."""


class TemplateMismatchError(ValueError):
    """A ``like=`` template asks for a shape or dtype that differs from the stored array."""


class CheckpointNotFoundError(FileNotFoundError):
    """No committed checkpoint exists at the given path.

    Raised as ``CheckpointNotFoundError(errno.ENOENT, message, path)``, so ``errno`` and
    ``filename`` are set as for any missing file, but it prints as the message alone: the
    message names the path already, and ``OSError``'s own form would add ``[Errno 2]`` and the
    path a second time.
    """

    def __str__(self) -> str:
        return self.strerror if self.strerror is not None else super().__str__()


class CheckpointExistsError(FileExistsError):
    """A committed checkpoint already exists where a save was asked to write."""


class FormatError(ValueError):
    """The checkpoint's metadata is corrupt or not a layoutckpt format this version knows."""


class NewerFormatError(FormatError):
    """The checkpoint was written by a newer format version than this library reads."""


class SaveError(RuntimeError):
    """Writing a checkpoint failed on at least one rank; nothing was committed."""


class RankLostError(SaveError):
    """A rank left the world (died, or lost touch with the others) in the middle of a collective.

    The message names the rank and ``ranks`` lists them (group ranks; empty when the job's
    key-value store went with them and no rank can be named). In a save nothing was committed;
    a load or a manager's start raises it too, as the ``RuntimeError`` it is, in place of the
    backend's error (kept as ``__cause__``), which names only a network address.
    """

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks

    def __reduce__(self) -> tuple[type[RankLostError], tuple[str, list[int]]]:
        return type(self), (str(self), self.ranks)


class IntegrityError(ValueError):
    """Stored bytes fail their checksum: the array named in the message is damaged on storage."""


class ManagerLockedError(RuntimeError):
    """Another ``CheckpointManager`` holds the root directory; two would interleave their saves."""


class PersistError(SaveError):
    """A background copy of a fast-tier checkpoint to the durable tier failed; training went on,
    and the fast tier still holds the step."""


class PersistWarning(RuntimeWarning):
    """Issued by ``CheckpointManager.save`` for a background persist that failed since the last
    call: a warning, not an error, so that the training loop keeps going."""


# What a rank raises for the same failure on another rank (``same_kind``): errors made from a
# message alone, which a caller may catch by class whichever rank failed.
_RAISED_ELSEWHERE: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        LayoutError,
        InconsistentShardsError,
        WorldSizeError,
        InvalidNameError,
        TemplateMismatchError,
        FormatError,
        NewerFormatError,
        IntegrityError,
        ValueError,
        TypeError,
    )
}


def same_kind(names: Iterable[str]) -> type[Exception]:
    """The class to raise for failures other ranks raised, given their class names: their one
    class where it is one of the plain ones above, else ``RuntimeError``."""
    kinds = {_RAISED_ELSEWHERE.get(name, RuntimeError) for name in names}
    return kinds.pop() if len(kinds) == 1 else RuntimeError

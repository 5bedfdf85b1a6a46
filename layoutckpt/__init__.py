"""layoutckpt: checkpoints for distributed PyTorch as layouts over named meshes, stored as Zarr v3.

This module is a contents page; the implementation lives in the private modules.
"""

from ._dcp import import_dcp as import_dcp
from ._load import load as load
from ._load import load_async as load_async
from ._load import load_rank_state as load_rank_state
from ._manager import CheckpointManager as CheckpointManager
from ._reader import ArrayInfo as ArrayInfo
from ._reader import Reader as Reader
from ._reader import open as open  # noqa: A004 - the verb of the API
from ._safetensors import export_safetensors as export_safetensors
from ._safetensors import import_safetensors as import_safetensors
from ._save import SaveResult as SaveResult
from ._save import save as save
from ._save import save_async as save_async
from ._training import LoadStateResult as LoadStateResult
from ._training import get_state as get_state
from ._training import load_state as load_state
from ._training import set_state as set_state
from ._unpack import export_zarr as export_zarr
from .base._errors import CheckpointExistsError as CheckpointExistsError
from .base._errors import CheckpointNotFoundError as CheckpointNotFoundError
from .base._errors import FormatError as FormatError
from .base._errors import InconsistentShardsError as InconsistentShardsError
from .base._errors import IntegrityError as IntegrityError
from .base._errors import InvalidNameError as InvalidNameError
from .base._errors import LayoutError as LayoutError
from .base._errors import ManagerLockedError as ManagerLockedError
from .base._errors import NewerFormatError as NewerFormatError
from .base._errors import PersistError as PersistError
from .base._errors import PersistWarning as PersistWarning
from .base._errors import RankLostError as RankLostError
from .base._errors import SaveError as SaveError
from .base._errors import TemplateMismatchError as TemplateMismatchError
from .base._errors import WorldSizeError as WorldSizeError
from .base._futures import LoadFuture as LoadFuture
from .base._futures import SaveFuture as SaveFuture
from .base._metrics import Metrics as Metrics
from .base._options import IOConfig as IOConfig
from .base._version import __version__ as __version__
from .format._format import FORMAT_VERSION as FORMAT_VERSION
from .format._zarr_dtypes import register as _register_zarr_dtypes
from .layout._flat import Flat as Flat
from .layout._layout import Layout as Layout
from .layout._names import Rename as Rename
from .layout._names import Renumber as Renumber
from .layout._plan import shard_box as shard_box
from .layout._spec import Mesh as Mesh
from .layout._spec import P as P
from .layout._views import Fused as Fused
from .layout._views import Padded as Padded
from .tiers import TierMetrics as TierMetrics

_register_zarr_dtypes()

"""layoutckpt: checkpoints for distributed PyTorch as layouts over named meshes, stored as Zarr v3.

This module is a contents page; the implementation lives in the private modules.
"""

from ._errors import CheckpointExistsError as CheckpointExistsError
from ._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._errors import FormatError as FormatError
from ._errors import InconsistentShardsError as InconsistentShardsError
from ._errors import InvalidNameError as InvalidNameError
from ._errors import LayoutError as LayoutError
from ._errors import NewerFormatError as NewerFormatError
from ._errors import SaveError as SaveError
from ._errors import TemplateMismatchError as TemplateMismatchError
from ._errors import WorldSizeError as WorldSizeError
from ._format import FORMAT_VERSION as FORMAT_VERSION
from ._layout import Layout as Layout
from ._load import load as load
from ._plan import shard_box as shard_box
from ._reader import ArrayInfo as ArrayInfo
from ._reader import Reader as Reader
from ._reader import open as open  # noqa: A004 - the verb of the API
from ._save import SaveResult as SaveResult
from ._save import save as save
from ._spec import Mesh as Mesh
from ._spec import P as P
from ._version import __version__ as __version__
from ._zarr_dtypes import register as _register_zarr_dtypes

_register_zarr_dtypes()

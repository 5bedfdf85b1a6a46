"""The ``layoutckpt`` command line: look into, check, read, plan for, export and prune checkpoints.

Read it by command; each module parses one command's arguments and prints its results:

- ``_main``: the entry point (``layoutckpt.cli._main:main``): the parser, and errors mapped to
  exit codes (2 bad usage, 1 missing or damaged).
- ``_ls``: ``ls PATH`` on a checkpoint: its arrays, specs, values and metadata, as a tree (or,
  with ``--flat``, its names alone).
- ``_root``: a CheckpointManager root: ``ls ROOT`` (its steps and leftovers) and ``gc``.
- ``_read``: ``read PATH NAME``: ``--slice`` parsing, the read loop, ``.npy`` output.
- ``_verify``: ``verify PATH``: every checksum and shard; exit 1 if damaged.
- ``_plan``: ``plan PATH``: what each rank of another layout would read.
- ``_export``: ``export PATH DIR``: Hugging Face files (``--to safetensors``), or plain Zarr (``--to zarr``).
- ``_text``: shared output: human sizes, aligned tables, strict JSON, progress bars.
- ``_common``: shared input: the program name, ``UsageError``/``NotFound``, opening a checkpoint.
"""

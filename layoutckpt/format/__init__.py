"""The on-disk format (``docs/format.md``) as values: root and array documents, data types,
per-rank documents, the safetensors header and the OCDBT structures of packed checkpoints.
Parsing and checks only; no storage access.
"""

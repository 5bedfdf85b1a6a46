"""The on-disk format (``docs/format.md``) as values: root and array documents, data types,
per-rank documents and the safetensors header. Parsing and checks only; no storage access.
"""

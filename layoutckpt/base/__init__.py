"""Foundations every layer uses: the typed errors, the version, futures, metrics and worker threads.

Nothing here imports another part of layoutckpt.
"""

"""Foundations every layer uses: the typed errors, the version, futures, metrics, worker threads
and the pause of the garbage collector during a load.

Nothing here imports another part of layoutckpt.
"""

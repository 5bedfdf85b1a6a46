"""Reading, as plans and their execution.

``_read`` is the read engine: every read of stored arrays (``load``, ``open().read``,
``verify``, the CLI, safetensors export, the JAX loader) is a list of ``BoxRead`` requests that
it cuts into the pieces storage reads best, keeps within one budget of bytes in flight and
places straight into their destinations, with one damage check. ``_readplan`` is the pure plan
of a load under a target layout (what each rank reads, and what that costs), which
``layoutckpt plan`` prints.
"""

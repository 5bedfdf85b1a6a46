"""The ``layoutckpt`` command line (``_main``): look into, check, read, plan for, export and prune."""

"""The vocabulary of layouts and its arithmetic, pure: no I/O, no torch.

``Mesh`` and ``P`` (``_spec``), ordered rules from global names to specs (``_layout``), flat
ZeRO-style buffers (``_flat``), the box of each rank and the choice of writers (``_plan``), and the
state's tree of global names (``_tree``).
"""

"""Reading: the pure read plan of a load (``_readplan``) and the engine that executes reads
through storage with a bound on the bytes in flight (``_fetch``).
"""

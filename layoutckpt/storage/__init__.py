"""Where bytes live: locations (local directories, object-store prefixes, memory) with their
commit protocol, TensorStore's contexts and specs, the shard files of local checkpoints and the
OCDBT databases of packed ones.
"""

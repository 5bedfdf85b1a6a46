"""PyTorch at the edge: tensors to and from NumPy, DTensor placements, staging copies and the
process-group collectives a save or load needs. torch itself is imported on first use only.
"""

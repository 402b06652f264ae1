"""Training loops: the trainer behind ps-worker, its step functions, precision, and Overlap."""

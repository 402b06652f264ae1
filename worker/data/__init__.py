"""Data on shared storage: the datasets, ps-prepare, the manifest, streaming, storage URLs."""

"""Demos apart from the library: make demo's jobs (python -m worker.demos.demo, worker.demos.recsys)."""

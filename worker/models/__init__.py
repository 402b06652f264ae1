"""Model architectures: the built-in models ps-worker builds by name."""

"""paramserver's benchmark suite: `python bench/run.py --help`. Results go to bench/results/latest.{json,md,png}."""

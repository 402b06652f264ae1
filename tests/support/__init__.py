"""What tests share: jobs and servers to run against, waiting for a condition, references computed locally.

tests/ is on sys.path (pytest's rootdir-relative import of a folder without __init__.py), so a test imports
`from support.jobs import start_ps_server`. No test module imports another (tools/check_structure.py)."""

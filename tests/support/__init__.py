"""What tests share: jobs and servers to run against (jobs.py; raw_job.py: a one-shard job reached by raw stub and
raw frames; data_socket.py: its data socket by hand), small models (models.py), messages built by hand
(messages.py), waiting for a condition (waiting.py), references computed locally (references.py).

tests/ is on sys.path (pytest's rootdir-relative import of a folder without __init__.py), so a test imports
`from support.jobs import start_ps_server`. No test module imports another (tools/check_structure.py)."""

"""A shard's sparse tables: their rows in groups, the requests' rows, their checks, exports and initial rows."""

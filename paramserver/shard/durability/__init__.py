"""The shard's durability: the write-ahead log, checkpoints, and what ties them to a shard's state."""

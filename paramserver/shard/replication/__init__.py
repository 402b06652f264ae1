"""A replicated shard's side of replication: the shapes it hands updates to, and a backup's apply."""

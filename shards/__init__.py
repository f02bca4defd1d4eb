"""relicv2 shards stage."""

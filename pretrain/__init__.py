"""relicv2 pretrain stage."""

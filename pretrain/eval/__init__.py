"""pretrain.eval."""

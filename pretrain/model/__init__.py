"""pretrain.model."""

"""pretrain.views."""

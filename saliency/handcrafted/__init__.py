"""saliency.handcrafted."""

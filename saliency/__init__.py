"""relicv2 saliency stage."""

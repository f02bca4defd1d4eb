"""Evaluation of pretrained encoders (docs/design.md, "Layout")."""

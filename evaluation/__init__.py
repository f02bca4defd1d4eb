"""Evaluation of pretrained encoders: kNN, linear, fine-tuning, export and the report. Imports
`pretrain` (its checkpoints, distributed, config and schedule code); `pretrain` never imports it."""

"""The handcrafted saliency methods (RBD, MR, DSR, MC; registry in ``methods.py``) and their shared
building blocks: ``colour``, ``graph``, ``frame``, ``reconstruction``, ``slic``."""

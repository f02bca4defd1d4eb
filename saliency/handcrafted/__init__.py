"""The handcrafted saliency methods (RBD, MR, DSR, MC; the functions in ``methods.py``) and their shared
building blocks: ``colour``, ``graph``, ``frame``, ``reconstruction``, ``slic``.

The methods' names live here, not beside the functions, so that a job or a command that only names or
checks methods (a config, ``--method``'s help) does not import them and their numba, scipy and OpenCV.
"""

from __future__ import annotations

METHOD_NAMES = ("rbd", "mr", "dsr", "mc")
"""Every handcrafted method, in the order jobs run and report them (the keys of ``methods.METHODS``)."""


def resolve_methods(name: str) -> list[str]:
    """``"all"`` or a comma-separated list of method names -> validated list of names."""
    names = list(METHOD_NAMES) if name == "all" else [n.strip() for n in name.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHOD_NAMES]
    if unknown or not names:
        raise ValueError(
            f"unknown saliency method(s) {unknown or name!r}; choose from {', '.join(METHOD_NAMES)} or 'all'"
        )
    return names

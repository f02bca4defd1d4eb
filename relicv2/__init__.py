"""relicv2: ReLICv2 self-supervised pretraining with an offline saliency precompute.

The one installed name. Its sub-packages are the source tree's top-level folders (`jobs`, `shards`,
`models`, `saliency`, `pretrain`, `evaluation`, `cli`): the wheel installs them under this package
(`pyproject.toml`'s `package-dir`), so they keep their place at the top of the tree. Run from a clone
without installing (`PYTHONPATH=.`), they sit beside this folder, and the package's search path takes in
the clone's root so that `relicv2.pretrain` resolves the same way.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
# Installed, the stages are inside this folder; in a source tree they are its siblings (checked by a
# folder only the tree has at that place, so an installed copy never reaches into site-packages).
if not (_HERE / "pretrain").is_dir() and (_HERE.parent / "pretrain" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))

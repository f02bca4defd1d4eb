"""The out-of-distribution sets of the paper's robustness table, from class folders the user has, and how
their classes meet an ImageNet head's: for each of the set's classes, the head outputs counted correct.

Class lists shipped in `classlists/` (one wnid a line): `imagenet.txt`, ImageNet's 1,000 wnids in the
standard (sorted) class-index order; `imagenet-r.txt` and `imagenet-a.txt`, the 200 wnids of ImageNet-R
(Hendrycks et al. 2021, "The Many Faces of Robustness") and ImageNet-A (Hendrycks et al. 2021, "Natural
Adversarial Examples"), as their repositories' evaluation code lists them (copied from timm's
`data/_info/imagenet_{r,a}_synsets.txt`, the same lists). ObjectNet's mapping is not shipped: it is read
from the `mappings/` folder the dataset itself ships (see `objectnet_targets`).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

# name -> the class folders its layout has
OOD_SETS = {
    "imagenetv2-matched-frequency": "indices", "imagenetv2-threshold0.7": "indices",
    "imagenetv2-top-images": "indices", "imagenet-sketch": "imagenet", "imagenet-r": "imagenet-r",
    "imagenet-a": "imagenet-a", "objectnet": "objectnet",
}
OBJECTNET_MAPPINGS = ("folder_to_objectnet_label.json", "objectnet_to_imagenet_1k.json",
                      "pytorch_to_imagenet_2012_id.json", "imagenet_to_label_2012_v2")


class OodSetError(ValueError):
    """A folder whose layout or classes are not the named set's, or a head that cannot score it: one line."""


def class_list(name: str) -> list[str]:
    """A shipped class list (`imagenet`, `imagenet-r`, `imagenet-a`)."""
    return resources.files("relicv2.evaluation").joinpath("classlists", f"{name}.txt").read_text().split()


def _shown(names: set[str]) -> str:
    return ", ".join(sorted(names)[:3]) + (" ..." if len(names) > 3 else "")


def expected_folders(name: str, folder: Path) -> set[str]:
    """The class folder names the set `name` has."""
    kind = OOD_SETS[name]
    if kind == "indices":
        return {str(i) for i in range(1000)}
    if kind == "objectnet":
        return set(_read_json(folder / "mappings" / OBJECTNET_MAPPINGS[0], dict))
    return set(class_list(kind))


def image_folder(name: str, folder: Path) -> Path:
    """The folder of class folders to build shards from, checked against the set's classes (OodSetError
    naming what differs)."""
    if name not in OOD_SETS:
        raise OodSetError(f"unknown out-of-distribution set {name!r}: choose from {', '.join(OOD_SETS)}")
    root = folder / "images" if OOD_SETS[name] == "objectnet" else folder
    if not root.is_dir():
        raise OodSetError(f"{root} is not a folder; give {name} as the folder of its class folders"
                          + (" (ObjectNet: the folder holding images/ and mappings/)" if root != folder else ""))
    found = {entry.name for entry in root.iterdir() if entry.is_dir() and not entry.name.startswith(".")}
    expected = expected_folders(name, folder)
    missing, extra = expected - found, found - expected
    if missing or extra:
        parts = ([f"{len(missing)} of its {len(expected)} class folders are missing ({_shown(missing)})"] if missing
                 else []) + ([f"{len(extra)} folders are not {name} classes ({_shown(extra)})"] if extra else [])
        raise OodSetError(f"{root} is not {name}'s layout: {'; '.join(parts)}")
    return root


def head_wnids(classes: list[str], num_classes: int, head: object) -> list[str]:
    """The head's outputs as ImageNet wnids: its class names when they are ImageNet's 1,000, or the standard
    order for a head of 1,000 unnamed classes; else OodSetError."""
    imagenet = class_list("imagenet")
    if sorted(classes) == imagenet or (not classes and num_classes == len(imagenet)):
        return classes or imagenet
    raise OodSetError(f"the head {head} has {num_classes} classes ({_shown(set(classes))}), not ImageNet's 1,000 "
                      "wnids: the out-of-distribution sets need a head trained on ImageNet")


def targets(name: str, set_classes: list[str], wnids: list[str], folder: Path) -> list[list[int]]:
    """For each class of a built set (its folder names, in its index order), the head outputs counted
    correct (`wnids`: the head's outputs); [] for a class with none (its images are left out)."""
    index = {wnid: i for i, wnid in enumerate(wnids)}
    kind = OOD_SETS[name]
    if kind == "indices":  # ImageNetV2: folder k is ImageNet class k
        imagenet = class_list("imagenet")
        return [[index[imagenet[int(k)]]] for k in set_classes]
    if kind == "objectnet":
        return objectnet_targets(set_classes, folder / "mappings", index)
    return [[index[wnid]] for wnid in set_classes]


def _read_json(path: Path, kind: type) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise OodSetError(f"{path} is not readable JSON ({error}); use the mappings ObjectNet ships") from None
    if not isinstance(value, kind):
        raise OodSetError(f"{path} is not a JSON {kind.__name__}; use the mappings ObjectNet ships")
    return value


def objectnet_targets(set_classes: list[str], mappings: Path, index: dict[str, int]) -> list[list[int]]:
    """ObjectNet's classes that overlap ImageNet, through the mapping files it ships in `mappings/`:
    folder -> ObjectNet label (`folder_to_objectnet_label.json`) -> ImageNet labels, "; "-separated
    (`objectnet_to_imagenet_1k.json`) -> lines of `imagenet_to_label_2012_v2` (one label a line, by
    ILSVRC-2012 id) -> class indices of the standard order (`pytorch_to_imagenet_2012_id.json`, index ->
    2012 id) -> the head's outputs. A label not found in the label file is refused (a mapping that does
    not match)."""
    folder_label, to_imagenet, to_2012 = (_read_json(mappings / n, dict) for n in OBJECTNET_MAPPINGS[:3])
    try:
        labels = (mappings / OBJECTNET_MAPPINGS[3]).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise OodSetError(f"{mappings / OBJECTNET_MAPPINGS[3]} cannot be read ({error})") from None
    imagenet = class_list("imagenet")
    ids = sorted(to_2012.values()) if all(isinstance(v, int) for v in to_2012.values()) else []
    base = 0 if ids == list(range(1000)) else 1 if ids == list(range(1, 1001)) else None
    if base is None or sorted(to_2012) != sorted(map(str, range(1000))) or len(labels) != 1000:
        raise OodSetError(f"{mappings} does not hold ObjectNet's ImageNet mapping: "
                          f"{OBJECTNET_MAPPINGS[2]} must map the 1,000 class indices to the 1,000 ILSVRC-2012 "
                          f"ids and {OBJECTNET_MAPPINGS[3]} list 1,000 labels")
    by_label: dict[str, list[int]] = {}
    for pytorch_index, id_2012 in to_2012.items():
        by_label.setdefault(labels[id_2012 - base].strip(), []).append(index[imagenet[int(pytorch_index)]])
    result = []
    for folder in set_classes:
        names = [n.strip() for n in str(to_imagenet.get(folder_label.get(folder), "")).split(";") if n.strip()]
        unknown = [n for n in names if n not in by_label]
        if unknown:
            raise OodSetError(f"{mappings / OBJECTNET_MAPPINGS[1]} maps {folder_label[folder]!r} to {unknown[0]!r}, "
                              f"which {OBJECTNET_MAPPINGS[3]} does not list: the mapping does not match")
        result.append(sorted({i for n in names for i in by_label[n]}))
    return result

"""`relicv2 eval segment`: the mIoU, the three layouts' listings and their refusals, the network's output size,
resuming an interrupted run, and the command on a crafted folder set."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from relicv2.cli.eval import eval_group
from relicv2.evaluation import segment as segment_module
from relicv2.evaluation import supervised
from relicv2.evaluation.report.html import ReportInputs, build_report
from relicv2.evaluation.segment import (
    SegmentationNet,
    class_iou,
    confusion,
    load_segment_config,
    mean_iou,
    segment,
)
from relicv2.evaluation.segment_data import (
    IGNORE,
    SegmentDataError,
    SegmentViews,
    list_pairs,
    read_pair,
    train_ids,
)
from relicv2.models.resnet import resnet


def test_miou_against_a_hand_computed_case_with_ignored_pixels():
    labels = torch.tensor([[0, 0, 1, 1], [2, 2, IGNORE, IGNORE]])
    predicted = torch.tensor([[0, 1, 1, 1], [2, 0, 2, 0]])  # the two ignored pixels are wrong: never counted
    matrix = confusion(predicted, labels, 3)
    assert matrix.tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]
    # class 0: TP 1, FP 1 (a 2 called 0), FN 1 -> 1/3; class 1: TP 2, FP 1 -> 2/3; class 2: TP 1, FN 1 -> 1/2
    assert class_iou(matrix) == pytest.approx([1 / 3, 2 / 3, 1 / 2])
    assert mean_iou(matrix) == pytest.approx((1 / 3 + 2 / 3 + 1 / 2) / 3)
    # A class neither present nor predicted has no IoU and does not pull the mean down.
    four = confusion(predicted, labels, 4)
    assert class_iou(four)[3] is None and mean_iou(four) == pytest.approx(mean_iou(matrix))


def _pair(folder: Path, name: str, mask: np.ndarray, size: tuple[int, int] | None = None) -> None:
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "masks").mkdir(parents=True, exist_ok=True)
    height, width = mask.shape if size is None else size
    rng = np.random.default_rng(len(name))
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(folder / "images" / f"{name}.jpg")
    Image.fromarray(mask.astype(np.uint8), "L").save(folder / "masks" / f"{name}.png")


def _saliency_folder(root: Path, count: int = 8, side: int = 40) -> Path:
    """Grey 0-255 masks (a bright square on dark) like a saliency benchmark's."""
    for index in range(count):
        mask = np.zeros((side, side), np.uint8)
        mask[8 + index % 3:28, 10:30 - index % 4] = 200
        _pair(root, f"{index:04d}", mask)
    return root


def test_folder_layout_lists_pairs_by_name_subfolder_or_list(tmp_path):
    root = _saliency_folder(tmp_path / "set", count=4)
    assert [p.key for p in list_pairs("folder", root, "")] == ["0000", "0001", "0002", "0003"]
    (tmp_path / "val.txt").write_text("0003\n0001\n")
    assert [p.key for p in list_pairs("folder", root, str(tmp_path / "val.txt"))] == ["0001", "0003"]
    _saliency_folder(root / "train", count=2)
    assert [p.key for p in list_pairs("folder", root, "train")] == ["0000", "0001"]
    with pytest.raises(SegmentDataError, match="'test' is neither a subfolder of .* nor a file of image names"):
        list_pairs("folder", root, "test")
    (tmp_path / "more.txt").write_text("0001\n0009\n")
    with pytest.raises(SegmentDataError, match=r"1 name\(s\) have no image in .* \(e\.g\. 0009\)"):
        list_pairs("folder", root, str(tmp_path / "more.txt"))
    (tmp_path / "blank.txt").write_text("# no names\n\n")
    with pytest.raises(ValueError, match=r"^split file .*blank\.txt holds no names$"):
        list_pairs("folder", root, str(tmp_path / "blank.txt"))


def test_folder_layout_refuses_a_missing_mask_and_a_mask_of_another_size(tmp_path):
    root = _saliency_folder(tmp_path / "set", count=3)
    (root / "masks" / "0001.png").unlink()
    with pytest.raises(SegmentDataError, match=r"0001\.png: the mask of 0001 is missing"):
        list_pairs("folder", root, "")
    _pair(root, "0001", np.zeros((40, 30)), size=None)
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(root / "images" / "0001.jpg")
    with pytest.raises(SegmentDataError, match=r"0001\.png: the mask is 30x40 but its image 0001\.jpg is 40x40"):
        list_pairs("folder", root, "")


def test_index_masks_beyond_the_classes_and_binarised_grey_masks(tmp_path):
    mask = np.array([[0, 1, 255], [2, 7, 0]], np.uint8)
    _pair(tmp_path, "a", mask)
    (pair,) = list_pairs("folder", tmp_path, "")
    with pytest.raises(SegmentDataError, match="class index 7 is beyond the 3 classes"):
        read_pair(pair, num_classes=3)
    assert read_pair(pair, num_classes=8)[1].tolist() == mask.tolist()  # indices as stored, 255 kept
    grey = np.array([[0, 127, 128], [200, 255, 3]], np.uint8)
    _pair(tmp_path, "a", grey)
    assert read_pair(pair, num_classes=2, binarise=128)[1].tolist() == [[0, 0, 1], [1, 1, 0]]
    Image.fromarray(np.zeros((2, 3, 3), np.uint8)).save(tmp_path / "masks" / "a.png")  # a colour-coded mask
    with pytest.raises(ValueError, match=r"a\.png: a RGB image is not an index mask"):
        read_pair(pair, num_classes=21)
    views = SegmentViews([pair], train=False, num_classes=21, crop_size=16)
    assert views[0] == "a"  # left out by its key, counted in the result


def _palette_png(path: Path, mask: np.ndarray) -> None:
    image = Image.fromarray(mask.astype(np.uint8), "P")
    image.putpalette([v for i in range(256) for v in ((i * 37) % 256, (i * 91) % 256, (i * 13) % 256)])
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def test_voc_layout_lists_image_sets_and_train_aug(tmp_path):
    voc = tmp_path / "VOCdevkit" / "VOC2012"
    for name in ("2007_000032", "2007_000039", "2007_000063"):
        (voc / "JPEGImages").mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.zeros((12, 16, 3), np.uint8)).save(voc / "JPEGImages" / f"{name}.jpg")
        _palette_png(voc / "SegmentationClass" / f"{name}.png", np.full((12, 16), 15))
        _palette_png(voc / "SegmentationClassAug" / f"{name}.png", np.full((12, 16), 3))
    sets = voc / "ImageSets" / "Segmentation"
    sets.mkdir(parents=True)
    (sets / "train.txt").write_text("2007_000032\n2007_000039\n")
    (sets / "val.txt").write_text("2007_000063\n")
    (sets / "train_aug.txt").write_text("2007_000032\n2007_000039\n2007_000063\n")
    (val,) = list_pairs("voc", tmp_path, "val")
    assert val.key == "2007_000063" and val.mask.parent.name == "SegmentationClass"
    assert read_pair(val, num_classes=21)[1].max() == 15  # the palette's indices, not its colours
    aug = list_pairs("voc", tmp_path, "train_aug")
    assert [p.key for p in aug] == ["2007_000032", "2007_000039", "2007_000063"]
    assert {p.mask.parent.name for p in aug} == {"SegmentationClassAug"}
    with pytest.raises(SegmentDataError, match="not a PASCAL VOC 2012 layout"):
        list_pairs("voc", tmp_path / "VOCdevkit", "val")


def test_cityscapes_layout_lists_fine_pairs_and_maps_label_ids_to_train_ids(tmp_path):
    for split, city, frame in (("train", "aachen", "aachen_000000_000019"), ("val", "lindau", "lindau_000000_000019")):
        images, labels = tmp_path / "leftImg8bit" / split / city, tmp_path / "gtFine" / split / city
        images.mkdir(parents=True)
        labels.mkdir(parents=True)
        Image.fromarray(np.zeros((8, 16, 3), np.uint8)).save(images / f"{frame}_leftImg8bit.png")
        ids = np.array([[7] * 8 + [26] * 8] * 4 + [[0] * 16] * 4, np.uint8)  # road, car, unlabeled
        Image.fromarray(ids, "L").save(labels / f"{frame}_gtFine_labelIds.png")
    (pair,) = list_pairs("cityscapes", tmp_path, "train")
    assert pair.key == "aachen_000000_000019" and pair.mask.name.endswith("_gtFine_labelIds.png")
    mask = read_pair(pair, num_classes=19, table=train_ids())[1]
    assert set(np.unique(mask).tolist()) == {0, 13, IGNORE}  # road is train id 0, car 13, unlabeled ignored
    assert [p.key for p in list_pairs("cityscapes", tmp_path, "val")] == ["lindau_000000_000019"]


@pytest.mark.parametrize("depth", [18, 50])
def test_the_network_keeps_the_input_size_and_the_encoder_weights(depth):
    encoder = resnet(depth)
    names = {name: tuple(value.shape) for name, value in encoder.state_dict().items()}
    net = SegmentationNet(encoder, num_classes=5).eval()
    assert {k.removeprefix("encoder."): tuple(v.shape) for k, v in net.state_dict().items()
            if k.startswith("encoder.")} == names  # a pretrained encoder loads as it is
    with torch.no_grad():
        logits = net(torch.randn(1, 3, 37, 53))
        assert logits.shape == (1, 5, 37, 53)
        e = net.encoder  # output stride 16: the stem and layer2, layer3 halve; layer4 is dilated instead
        assert e.layer4(e.layer3(e.layer2(e.layer1(e.maxpool(e.conv1(torch.randn(1, 3, 64, 64))))))).shape[-2:] == (4, 4)


def test_train_views_are_crops_of_image_and_mask_together(tmp_path):
    mask = np.zeros((24, 24), np.uint8)
    mask[4:16, 6:20] = 255
    _pair(tmp_path, "a", mask)
    Image.fromarray(np.repeat(mask[:, :, None], 3, axis=2)).save(tmp_path / "images" / "a.png")  # white object
    (tmp_path / "images" / "a.jpg").unlink()
    views = SegmentViews(list_pairs("folder", tmp_path, ""), train=True, num_classes=2, crop_size=32, binarise=128,
                         scale=(0.5, 1.0))
    for epoch in range(4):
        views.epoch = epoch
        image, labels = views[0]
        assert image.shape == (3, 32, 32) and labels.shape == (32, 32)
        assert (labels == IGNORE).any()  # at most 24 px: padded to the crop, the padding ignored
        red = image[0]
        assert red[labels == 1].mean() > 1.5 and red[labels != 1].mean() < -1.5  # the object where its mask is


def _fast(tmp_path: Path, *extra: str):
    (tmp_path / "train.txt").write_text("\n".join(f"{i:04d}" for i in range(6)) + "\n")
    (tmp_path / "val.txt").write_text("0006\n0007\n")
    return load_segment_config("fast", ["binarise=128", f"train_split={tmp_path / 'train.txt'}",
                                        f"val_split={tmp_path / 'val.txt'}", "resize=32", "crop_size=32",
                                        "batch_size=3", "workers=0", "epochs=2", *extra])


def _encoder(seed: int = 0):
    """The same random ResNet-18 for the same seed, as `--random-init 18 --seed` gives."""
    torch.manual_seed(seed)
    return resnet(18)


def test_an_interrupted_run_resumes_from_its_last_epoch_and_ends_alike(tmp_path, monkeypatch):
    data = _saliency_folder(tmp_path / "set")
    config = _fast(tmp_path)
    whole = segment(_encoder(), data, config, device=torch.device("cpu"), output_dir=tmp_path / "whole", log=print)

    saves = []
    original = supervised.StateFile.save

    def save_then_die(self, epoch, model, optimizer):
        original(self, epoch, model, optimizer)
        saves.append(epoch)
        raise KeyboardInterrupt  # killed right after the first epoch's state was written

    monkeypatch.setattr(supervised.StateFile, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        segment(_encoder(), data, config, device=torch.device("cpu"), output_dir=tmp_path / "cut", log=print)
    monkeypatch.setattr(supervised.StateFile, "save", original)
    epochs_read = []
    batches = segment_module.epoch_batches
    monkeypatch.setattr(segment_module, "epoch_batches",
                        lambda views, epoch, **kw: (epochs_read.append((views.train, epoch)), batches(views, epoch, **kw))[1])
    resumed = segment(_encoder(), data, config, device=torch.device("cpu"), output_dir=tmp_path / "cut", log=print)
    assert saves == [1] and epochs_read == [(True, 1), (False, 0)]  # only the second epoch was trained again
    assert resumed["confusion"] == whole["confusion"] and resumed["miou"] == whole["miou"]
    with pytest.raises(ValueError, match="other segmentation options"):
        segment(_encoder(), data, _fast(tmp_path, "lr=0.01"), device=torch.device("cpu"),
                output_dir=tmp_path / "cut", log=print)
    # Another encoder, or other training images, in the same --output: refused, not resumed as if the same.
    with pytest.raises(ValueError, match="written for another encoder; use another --output folder"):
        segment(_encoder(seed=1), data, config, device=torch.device("cpu"), output_dir=tmp_path / "cut", log=print)
    (tmp_path / "train.txt").write_text("0000\n0001\n0002\n0003\n0004\n")  # the same split file, edited
    with pytest.raises(ValueError, match="written for another training set"):
        segment(_encoder(), data, config, device=torch.device("cpu"), output_dir=tmp_path / "cut", log=print)


def test_the_command_writes_the_json_and_refuses_bad_input_in_one_line(tmp_path):
    data = _saliency_folder(tmp_path / "set")
    config = _fast(tmp_path)
    base = ["segment", "--random-init", "18", "--data", str(data), "--config", "fast", "--device", "cpu"]
    for setting in ("resize=32", "crop_size=32", "epochs=1", "workers=0", "batch_size=3"):
        base += ["--set", setting]
    args = [*base, "--set", "binarise=128"]
    splits = ["--set", f"train_split={config.train_split}", "--set", f"val_split={config.val_split}"]
    result = CliRunner().invoke(eval_group, [*args, *splits, "--output", str(tmp_path / "out"), "--json",
                                             str(tmp_path / "seg.json")])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "seg.json").read_text())
    assert record == json.loads((tmp_path / "out" / "segment.json").read_text())
    assert record["protocol"] == "segment-fast" and record["num_train"] == 6 and record["num_val"] == 2
    assert set(record["per_class_iou"]) == {"0", "1"} and 0 <= record["miou"] <= 1
    assert sum(map(sum, record["confusion"])) == 2 * 32 * 32  # every val pixel scored once, at the resized size
    # The report reads the output folder: one row with the figures, a broken file named and left out.
    (tmp_path / "broken.json").write_text('{"encoder": "x"}')
    summary = build_report(ReportInputs(segment=(tmp_path / "out", tmp_path / "broken.json")), tmp_path / "r.html")
    assert summary.sections["segmentation"] == "ok" and any("broken.json" in p for p in summary.problems)
    text = summary.page.read_text()
    assert f"{record['miou']:.4f}" in text and "random-init ResNet-18" in text and "IoU 1" in text
    assert "segmentation" not in build_report(ReportInputs(), tmp_path / "none.html").sections
    (data / "masks" / "0007.png").unlink()
    result = CliRunner().invoke(eval_group, [*args, *splits, "--output", str(tmp_path / "out2")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = [text for text in result.output.splitlines() if text.startswith("Error")]
    assert "0007.png: the mask of 0007 is missing" in line
    (data / "masks" / "0007.png").write_bytes((data / "masks" / "0006.png").read_bytes())
    # Grey masks read as class indices (no binarise): every pair is beyond the 2 classes, the job fails.
    result = CliRunner().invoke(eval_group, [*base, "--set", "num_classes=2", *splits,
                                             "--output", str(tmp_path / "out4")])
    assert result.exit_code == 1 and "every pair of" in result.output and "was unusable" in result.output
    result = CliRunner().invoke(eval_group, [*args, "--output", str(tmp_path / "out3")])  # no splits: one set
    assert result.exit_code == 1 and "scored on the images it trained on" in result.output

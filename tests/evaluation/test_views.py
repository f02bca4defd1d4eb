"""Evaluation views read every image member name WebDataset users write (jpg, jpeg, png, webp)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from relicv2.evaluation.dali_views import DaliViews
from relicv2.evaluation.features import shard_set_fingerprint
from relicv2.evaluation.views import LabelledViews, labelled_samples
from relicv2.shards import ShardSample, resolve_shard_set, write_shard_set
from relicv2.shards.sample import IMAGE_MEMBERS

FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}


@pytest.fixture(scope="module")
def mixed_formats(tmp_path_factory):
    """8 samples, two per image member name, each a flat colour that encodes its label."""
    samples = []
    for i in range(8):
        member = IMAGE_MEMBERS[i % len(IMAGE_MEMBERS)]
        buffer = io.BytesIO()
        Image.new("RGB", (40, 32), (30 * i, 0, 0)).save(buffer, FORMATS[member], quality=95)
        samples.append(ShardSample(f"m{i}", {member: buffer.getvalue()}, label=i))
    out = tmp_path_factory.mktemp("mixed")
    write_shard_set(samples, out)
    return out


def test_pil_views_read_every_image_member(mixed_formats):
    samples, lost = labelled_samples(mixed_formats)
    assert not lost and len(samples) == 8
    views = LabelledViews(samples, train=False, crop_size=16, resize_size=16)
    items = [views[i] for i in range(len(views))]
    assert all(item is not None for item in items)
    reds = {label: float(view[0].mean()) for view, label in items}
    assert sorted(reds) == list(range(8))
    assert all(reds[i] < reds[i + 1] for i in range(7))  # each image decoded, not a placeholder


def test_dali_views_read_every_image_member(mixed_formats):
    views = DaliViews(mixed_formats, train=False, crop_size=16, resize_size=16, batch_size=8, threads=1)
    assert not views.sample_set.skipped_keys
    images, labels, _ = next(iter(views.epoch()))
    assert sorted(labels.tolist()) == list(range(8))
    assert images.shape == (8, 3, 16, 16)  # CHW
    red = images.float().flatten(2).mean(-1)[:, 0]
    order = torch.argsort(labels)
    assert torch.all(red[order][1:] > red[order][:-1])  # each image decoded, not a placeholder


def test_plain_webdataset_shards_by_brace_pattern(tmp_path, monkeypatch):
    """A labelled set written by webdataset's ShardWriter (no manifest, no index, `val-NNNN.tar`)."""
    import webdataset as wds

    with wds.ShardWriter(str(tmp_path / "val-%04d.tar"), maxcount=3, verbose=0) as sink:
        for i in range(6):
            buffer = io.BytesIO()
            Image.new("RGB", (40, 32), (40 * i, 0, 0)).save(buffer, "PNG")
            sink.write({"__key__": f"v{i}", "png": buffer.getvalue(), "cls": str(i).encode()})
    monkeypatch.setenv("RELICV2_INDEX_CACHE", str(tmp_path / "cache"))
    samples, lost = labelled_samples(str(tmp_path / "val-{0000..0001}.tar"))
    assert [name for name, _, _ in shard_set_fingerprint(resolve_shard_set(str(tmp_path / "val-{0000..0001}.tar")))] == [
        "val-0000.tar", "val-0001.tar"]  # the feature cache keys a pattern by its tars
    assert not lost and sorted(s.key for s in samples) == [f"v{i}" for i in range(6)]
    views = DaliViews(tmp_path, train=False, crop_size=16, resize_size=16, batch_size=6, threads=1)
    _, labels, _ = next(iter(views.epoch()))
    assert sorted(labels.tolist()) == list(range(6))


@pytest.mark.parametrize("backend", ["pil", "dali"])
def test_class_names_in_cls_members_are_one_clear_error_before_training(tmp_path, monkeypatch, backend):
    """Other tools write class names into `cls`; a trained-head evaluation needs indices and says so."""
    import webdataset as wds
    from click.testing import CliRunner

    from relicv2.cli.eval import eval_group

    with wds.ShardWriter(str(tmp_path / "named-%04d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(4):
            buffer = io.BytesIO()
            Image.new("RGB", (40, 32), (40 * i, 0, 0)).save(buffer, "PNG")
            sink.write({"__key__": f"n{i}", "png": buffer.getvalue(), "cls": ("tench", "church")[i % 2].encode()})
    monkeypatch.setenv("RELICV2_INDEX_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(eval_group, [
        "linear", "--random-init", "18", "--train", str(tmp_path), "--val", str(tmp_path), "--device", "cpu",
        "--set", f"backend={backend}", "--set", "epochs=1", "--set", "crop_size=16", "--set", "resize_size=16"])
    assert result.exit_code == 1, result.output
    assert "sample n0 in named-0000.tar has cls 'tench', not a class index" in result.output
    assert "relicv2 shards build" in result.output and "Traceback" not in result.output


def test_a_resize_of_0_is_the_centre_crop_rule_on_both_view_paths(tmp_path):
    """resize_size=0 means crop / 0.875 (`resize_of`) for the PIL and the DALI test views, as for kNN."""
    from relicv2.pretrain.views.config import resize_of

    buffer = io.BytesIO()
    Image.radial_gradient("L").convert("RGB").save(buffer, "PNG")  # 256 x 256, every pixel its own
    write_shard_set([ShardSample("g", {"png": buffer.getvalue()}, label=0)], tmp_path)
    samples, _ = labelled_samples(tmp_path)
    by_rule, explicit = (LabelledViews(samples, train=False, crop_size=16, resize_size=size)[0][0]
                         for size in (0, resize_of(16)))
    assert torch.equal(by_rule, explicit)
    assert not torch.equal(by_rule, LabelledViews(samples, train=False, crop_size=16, resize_size=40)[0][0])
    dali = [next(iter(DaliViews(tmp_path, train=False, crop_size=16, resize_size=size, batch_size=1,
                                threads=1).epoch()))[0] for size in (0, resize_of(16), 40)]
    assert torch.equal(dali[0], dali[1]) and not torch.equal(dali[0], dali[2])


@pytest.mark.parametrize("width, height, crop, resize", [
    (256, 256, 16, 0), (40, 32, 16, 0), (32, 40, 16, 18), (97, 61, 24, 0), (61, 97, 24, 27), (50, 50, 32, 32),
    (33, 80, 32, 20), (80, 33, 32, 21), (64, 48, 32, 27),  # a side shorter than the crop: padded with black
])
def test_the_torch_free_test_view_is_torchvisions_pixel_for_pixel(width, height, crop, resize):
    import torchvision.transforms.v2.functional as TF
    from torchvision.transforms import InterpolationMode

    from relicv2.pretrain.knn.view import test_view_image
    from relicv2.pretrain.views.config import resize_of

    rng = torch.Generator().manual_seed(width * height + crop)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=rng).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    expected = TF.center_crop(TF.resize(Image.fromarray(pixels), [resize_of(crop, resize)],
                                        interpolation=InterpolationMode.BICUBIC, antialias=True), [crop, crop])
    view = test_view_image(buffer.getvalue(), crop_size=crop, resize_size=resize)
    assert view.size == (crop, crop) and view.tobytes() == expected.tobytes()


def test_a_corruption_worker_imports_no_torch():
    """The corruption workers only make views and corrupt them: torch's import would cost each ~0.7 GB."""
    import subprocess
    import sys

    from tests.paths import REPO

    code = "import sys, relicv2.evaluation.corrupted; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision')))"
    printed = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert printed.strip() == "[]"

"""The cached sample checks are bound to the tar they judge and to the checker."""

from __future__ import annotations

import io
import json

from PIL import Image

from relicv2.shards.checks import CHECKS_FOLDER, check_shard_set


def test_a_planted_verdict_file_does_not_switch_off_the_checks(tmp_path):
    import webdataset as wds

    from tests.shards.test_hostile import bomb_png

    (tmp_path / "wds").mkdir()
    with wds.ShardWriter(str(tmp_path / "wds" / "train-%04d.tar"), maxcount=10, verbose=0) as sink:
        for i in range(3):
            image = io.BytesIO()
            Image.new("RGB", (40, 32), (i, 0, 0)).save(image, "PNG")
            sink.write({"__key__": f"s{i}", "png": image.getvalue()})
        sink.write({"__key__": "bomb", "png": bomb_png()})
    cache = tmp_path / "cache"
    assert dict(check_shard_set(tmp_path / "wds", index_cache=cache, progress=False).left_out) == {"too_large": 1}
    [verdict] = (cache / CHECKS_FOLDER).glob("*.json")
    verdict.write_text(json.dumps({"samples": 4, "left_out": []}))  # what someone with write access could plant
    again = check_shard_set(tmp_path / "wds", index_cache=cache, progress=False)
    assert dict(again.left_out) == {"too_large": 1} and again.fresh == 1


def test_a_few_bytes_that_are_no_image_are_not_an_image_and_nothing_is_empty(tmp_path):
    """An 11-byte text is `not_an_image`; only a member of no bytes is `empty_image`."""
    from relicv2.shards import ShardSample, write_shard_set

    image = io.BytesIO()
    Image.new("RGB", (16, 16), (9, 9, 9)).save(image, "JPEG")
    samples = [ShardSample("good", {"jpg": image.getvalue()}), ShardSample("text", {"jpg": b"hello world"}),
               ShardSample("empty", {"jpg": b""})]
    write_shard_set(samples, tmp_path / "set")
    left_out = check_shard_set(tmp_path / "set", index_cache=tmp_path / "cache", progress=False).left_out
    assert dict(left_out) == {"not_an_image": 1, "empty_image": 1}

"""`benchmarks/saliency_selection.py`: trains each recipe once a seed on unlabelled folders, scores every candidate
on the dev images once, records the rows as they come, resumes, and refuses a dev image in a training folder."""

from __future__ import annotations

import json
import shutil

import pytest

from relicv2.shards.build import BuildConfig, build_shards
from tests.paths import load_benchmark
from tests.scenes import write_scenes


def _rows(out):
    return {(row["candidate"], row["seed"]): row for row in map(json.loads, (out / "rows.jsonl").read_text().splitlines())}


@pytest.fixture
def folders(tmp_path):
    write_scenes(tmp_path / "a", range(4))
    write_scenes(tmp_path / "b", range(4, 8))
    write_scenes(tmp_path / "dev", range(20, 26), masks=tmp_path / "masks", size=(60, 80))
    return tmp_path


def _argv(tmp_path, out, *extra):
    return ["--out", str(out), "--train-images", str(tmp_path / "a"), "--train-images", str(tmp_path / "b"),
            "--dev-images", str(tmp_path / "dev"), "--dev-masks", str(tmp_path / "masks"), "--recipe", "t=tiny",
            "--set", "fuse_epochs=1", "--seeds", "0", "1", "--folds", "3", *extra]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_scores_every_candidate_once_a_seed_and_resumes_to_the_same_rows(folders, capsys):
    out = folders / "out"
    script = load_benchmark("saliency_selection")
    assert script.main(_argv(folders, out)) == 0
    printed = capsys.readouterr().out
    handcrafted = ["rbd", "mr", "dsr", "mc", "mean of handcrafted"]
    network = [f"t: fused network{suffix}" for suffix in ("", ", flip", " + CRF", ", flip + CRF", " + maps",
                                                          ", flip + maps")]
    rows = _rows(out)
    # The handcrafted rows once, the network's once a seed, each on the 6 dev images.
    assert set(rows) == {(n, None) for n in handcrafted} | {(n, s) for n in network for s in (0, 1)}
    assert all(row["images"] == 6 for row in rows.values())
    # Each seed trained its own network (the config's seed), on the two folders (tiny samples 8 images).
    for seed in (0, 1):
        report = json.loads((out / "train" / "t" / f"seed-{seed}" / "report.json").read_text())
        assert report["images"] == 8
    assert rows[("t: fused network", 0)]["max_f"] != rows[("t: fused network", 1)]["max_f"]
    # The training images' maps are computed once for every run.
    for seed in (0, 1):
        assert (out / "train" / "t" / f"seed-{seed}" / "maps").resolve() == (out / "train-maps").resolve()
    assert len(list((out / "train-maps" / "rbd").glob("*.png"))) == 8
    # A row's figure is `saliency evaluate`'s on the same maps.
    from relicv2.saliency.evaluate import evaluate_folder
    assert rows[("rbd", None)]["max_f"] == pytest.approx(
        evaluate_folder(out / "heldout" / "maps" / "rbd", folders / "masks").max_f, abs=1e-12)
    table = {line.split("|")[1].strip(): line for line in printed.splitlines() if line.startswith("| ")}
    assert all(name in table for name in handcrafted + network[1:]) and "t: fused network (default)" in table
    assert "± " in table["t: fused network (default)"].split("|")[2]  # two seeds: a spread
    assert "±" not in table["rbd"].split("|")[2]  # the same maps whatever the seed
    assert "| 0 | " in printed and "| 1 | " in printed and "| all | selected pipeline |" in printed
    assert "6 dev images, 3 folds (fold seed 0), seeds 0, 1" in printed

    # Interrupted: the last rows lost and a line cut short by the kill. The rerun trains nothing again and
    # scores the lost rows to the same figures.
    lines = (out / "rows.jsonl").read_text().splitlines()
    (out / "rows.jsonl").write_text("\n".join(lines[:-4]) + "\n" + lines[-4][:20])
    done = out / "train" / "t" / "seed-1" / "work" / "fused.done.pt"
    stamp = done.stat().st_mtime_ns
    assert script.main(_argv(folders, out)) == 0
    assert capsys.readouterr().out.endswith(printed.split("recipes:", 1)[1])
    assert done.stat().st_mtime_ns == stamp
    again = _rows(out)
    assert again.keys() == rows.keys()
    assert all(again[key][m] == rows[key][m] for key in rows for m in ("mae", "max_f", "adaptive_f"))

    # The same recipe name with other settings is refused, not mixed in.
    assert script.main(_argv(folders, out, "--set", "epochs=3")) == 2
    assert "t: fused network" in capsys.readouterr().err

    # Coverage: the first seed's network masks a shard set at each option build-masks has; a rerun rebuilds none.
    build_shards(BuildConfig(input=folders / "b", out_dir=folders / "cover", progress=False, min_side=16, workers=1))
    assert script.main(_argv(folders, out, "--coverage-shards", str(folders / "cover"))) == 0
    printed = capsys.readouterr().out
    cover = {line.split("|")[1].strip(): line.split("|")[2:6] for line in printed.split("Mask coverage", 1)[1].splitlines()
             if line.startswith("| t: ")}
    assert list(cover) == ["t: fused network (default)", "t: fused network, flip", "t: fused network + CRF",
                           "t: fused network, flip + CRF"]
    for name, (masks, mean, below, histogram) in cover.items():
        assert int(masks) == 4 and 0 <= float(mean) <= 1 and sum(map(int, histogram.split())) == 4, name
        assert 0 <= int(below.split()[0]) <= 4, name
    info = json.loads((out / "coverage" / "t" / "plain-flip-crf" / "info.json").read_text())
    assert info["flip"] and info["crf"] and info["mask"]["coverage_histogram"] == [int(n) for n in cover["t: fused network, flip + CRF"][3].split()]
    tars = sorted((out / "coverage").rglob("*.tar"))
    stamps = [t.stat().st_mtime_ns for t in tars]
    assert script.main(_argv(folders, out, "--coverage-shards", str(folders / "cover"))) == 0
    assert capsys.readouterr().out == printed and [t.stat().st_mtime_ns for t in tars] == stamps


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_recipe_with_extra_images_trains_on_its_own_shards(folders, capsys):
    write_scenes(folders / "c", range(8, 12))
    out = folders / "out"
    argv = ["--out", str(out), "--train-images", str(folders / "a"), "--train-images", str(folders / "b"),
            "--dev-images", str(folders / "dev"), "--dev-masks", str(folders / "masks"), "--recipe", "t=tiny",
            "--recipe", f"more=tiny num_images=12 extra_images={folders / 'c'}", "--set", "fuse_epochs=1",
            "--seeds", "0", "--folds", "2"]
    assert load_benchmark("saliency_selection").main(argv) == 0
    assert json.loads((out / "train" / "t" / "seed-0" / "report.json").read_text())["images"] == 8
    assert json.loads((out / "train" / "more" / "seed-0" / "report.json").read_text())["images"] == 12
    (own,) = (out / "sets").iterdir()
    assert (out / "train" / "more" / "seed-0" / "maps").resolve() == (own / "train-maps").resolve()
    assert len(list((own / "train-maps" / "mr").glob("*.png"))) == 12
    assert len(list((out / "train-maps" / "mr").glob("*.png"))) == 8
    assert "| more: fused network, flip + CRF |" in capsys.readouterr().out
    # A rerun resumes; a recipe's folder that does not exist is one line.
    assert load_benchmark("saliency_selection").main(argv) == 0
    argv[argv.index(f"more=tiny num_images=12 extra_images={folders / 'c'}")] = "gone=tiny extra_images=/nonexistent"
    capsys.readouterr()
    assert load_benchmark("saliency_selection").main(argv) == 2
    assert "--recipe gone: extra_images=/nonexistent is not a folder" in capsys.readouterr().err
    # A recipe's own folder holding a dev image is refused as --train-images are.
    shutil.copy(folders / "dev" / "s21.jpg", folders / "c" / "copy.jpg")
    argv[argv.index("gone=tiny extra_images=/nonexistent")] = f"more=tiny extra_images={folders / 'c'}"
    assert load_benchmark("saliency_selection").main(argv) == 2
    assert "--recipe more extra_images " in (err := capsys.readouterr().err) and "copy.jpg is the dev image s21.jpg" in err


def test_a_dev_image_in_a_training_folder_is_refused_before_anything_runs(folders, capsys):
    shutil.copy(folders / "dev" / "s23.jpg", folders / "b" / "copy.jpg")
    assert load_benchmark("saliency_selection").main(_argv(folders, folders / "out")) == 2
    err = capsys.readouterr().err
    assert "copy.jpg is the dev image s23.jpg" in err and len(err.strip().splitlines()) == 1
    assert not (folders / "out").exists()


def test_a_bad_recipe_is_one_line(folders, capsys):
    assert load_benchmark("saliency_selection").main(_argv(folders, folders / "out", "--recipe", "no preset")) == 2
    assert "--recipe 'no preset': give NAME=PRESET" in capsys.readouterr().err

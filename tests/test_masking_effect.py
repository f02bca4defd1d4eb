"""`benchmarks/masking_effect.py`: its statistics, its random rectangle masks and the resuming of its rows."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tests.paths import load_benchmark

me = load_benchmark("masking_effect")


def test_identical_arms_differ_by_nothing():
    rng = np.random.default_rng(1)
    control = {s: rng.integers(0, 2, 500).astype(float) for s in (0, 1, 2)}
    same = {s: v.copy() for s, v in control.items()}
    delta = me.per_image_difference(same, control)
    assert np.all(delta == 0)
    low, high = me.bootstrap_interval(delta, reps=300)
    assert low <= 0 <= high
    figures = {s: float(v.mean()) for s, v in control.items()}
    assert me.paired_differences(figures, figures) == {0: 0.0, 1: 0.0, 2: 0.0}


def test_a_clear_effect_is_an_interval_without_zero_and_noise_is_one_with_it():
    rng = np.random.default_rng(2)
    control = {s: (rng.random(1000) < 0.5).astype(float) for s in (0, 1, 2)}
    better = {s: np.maximum(v, rng.random(1000) < 0.3) for s, v in control.items()}  # ~15 points more right
    low, high = me.bootstrap_interval(me.per_image_difference(better, control), reps=500)
    assert 0 < low < high
    noise = {s: (rng.random(1000) < 0.5).astype(float) for s in (0, 1, 2)}  # another draw of the same accuracy
    low, high = me.bootstrap_interval(me.per_image_difference(noise, control), reps=500)
    assert low < 0 < high


def test_paired_differences_pair_by_seed():
    diffs = me.paired_differences({0: 0.5, 1: 0.7, 3: 0.9}, {0: 0.4, 1: 0.75, 2: 0.1})
    assert diffs == pytest.approx({0: 0.1, 1: -0.05})
    assert me.mean_sd([0.1, -0.05]) == pytest.approx((0.025, np.std([0.1, -0.05], ddof=1)))
    assert me.per_image_difference({0: np.ones(3)}, {1: np.ones(3)}) is None  # no seed in common


@pytest.mark.parametrize(("height", "width"), [(112, 112), (40, 200), (200, 40), (7, 5)])
def test_a_rectangle_has_the_mask_area_within_one_row_and_lies_inside(height, width):
    rng = np.random.default_rng(0)
    for area in [1, 2, height * width // 3, height * width - 1, height * width, *rng.integers(1, height * width, 30)]:
        mask = me.random_rectangle(int(area), height, width, rng)
        assert mask.shape == (height, width)
        rows, cols = np.nonzero(mask)
        top, bottom, left, right = rows.min(), rows.max(), cols.min(), cols.max()
        assert mask[top : bottom + 1, left : right + 1].all()  # one filled rectangle, inside the image
        assert abs(int(mask.sum()) - area) <= right - left + 1, (area, mask.sum())
    assert not me.random_rectangle(0, height, width, rng).any()


def _mask_png() -> bytes:
    mask = np.zeros((60, 80), np.uint8)
    mask[10:40, 20:70] = 200  # 1,500 foreground pixels
    mask[45:50, 5:10] = 127  # under the foreground level
    buffer = io.BytesIO()
    Image.fromarray(mask).save(buffer, format="PNG")
    return buffer.getvalue()


def test_rectangles_are_seeded_by_seed_and_key():
    png = _mask_png()
    first = me.rectangle_like(png, 0, "img_1")
    assert np.array_equal(first, me.rectangle_like(png, 0, "img_1"))  # reproducible
    assert abs(first.sum() - 1500) <= 80
    others = [me.rectangle_like(png, seed, "img_1") for seed in (1, 2, 3)]
    assert any(not np.array_equal(first, other) for other in others)  # another seed, another place
    assert any(not np.array_equal(first, me.rectangle_like(png, 0, f"img_{k}")) for k in (2, 3, 4))  # per key


def test_a_recorded_row_is_not_measured_again(tmp_path):
    calls = []

    def measure(arm, seed):
        calls.append((arm, seed))
        return {"figure": len(calls)}

    rows = me.grid_rows(tmp_path, ["control", "pm0.1"], [0, 1], measure)
    assert calls == [("control", 0), ("pm0.1", 0), ("control", 1), ("pm0.1", 1)] and rows[("pm0.1", 1)]["figure"] == 4
    # A later run with more seeds, after a kill that cut the last line short: only the new rows and the
    # cut one are measured.
    path = tmp_path / me.ROWS
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:10])
    calls.clear()
    rows = me.grid_rows(tmp_path, ["control", "pm0.1"], [0, 1, 2], measure)
    assert calls == [("pm0.1", 1), ("control", 2), ("pm0.1", 2)]  # seed by seed: whole pairs first
    assert rows[("control", 0)]["figure"] == 1  # kept from the first run
    assert set(me.read_rows(path)) == {(arm, seed) for arm in ("control", "pm0.1") for seed in (0, 1, 2)}


def test_arms_are_parsed_or_refused():
    assert me.parse_arm("control") == me.Arm("control", 0.0, "none")
    assert me.parse_arm("pm0.3") == me.Arm("pm0.3", 0.3, "saliency")
    assert me.parse_arm("random0.1") == me.Arm("random0.1", 0.1, "random")
    for bad in ("pm", "pm2", "random-x", "masked"):
        with pytest.raises(ValueError):
            me.parse_arm(bad)


def test_the_table_shows_a_spread_only_over_seeds_and_pairs_by_seed(tmp_path):
    rng = np.random.default_rng(0)

    def row(arm, seed, p_m, masks, value):
        path = tmp_path / f"{arm}-{seed}.npz"
        np.savez(path, bg_gap=rng.integers(-1, 2, 50).astype(float), in_c=rng.random(50))
        return {"p_m": p_m, "masks": masks, "per_image": str(path),
                **{figure: value for figure in (*me.PRIMARY, *me.SECONDARY)}}

    rows = {("control", 0): row("control", 0, 0.0, "none", 0.40), ("control", 1): row("control", 1, 0.0, "none", 0.42),
            ("pm0.1", 0): row("pm0.1", 0, 0.1, "saliency", 0.45)}
    text = me.table(rows, ["control", "pm0.1"], reps=50)
    control, masked = (next(line for line in text.splitlines() if line.startswith(f"| {arm} | 0.")) for arm in
                       ("control", "pm0.1"))
    assert "0.4100 ± 0.0141" in control  # two seeds: mean and sample sd
    assert "0.4500 |" in masked and "±" not in masked  # one seed: no spread to show
    paired = next(line for line in text.splitlines() if line.startswith("| pm0.1 | ") and "seeds" in line)
    assert "(seeds +0.0500)" in paired and paired.count("CI [") == len(me.PRIMARY)  # paired on seed 0 alone

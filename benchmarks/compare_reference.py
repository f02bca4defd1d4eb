"""Compare our handcrafted saliency maps with the authors' reference maps on PASCAL-S dev.

Per method: mean absolute difference and Pearson correlation between our map and the
reference map (both min-max normalised, per image, then averaged), and MAE / max-F /
adaptive-F / S-measure of ours and of the reference maps against the ground truth on the
same images. DSR's reference covers images 0001-0100 only. Prints a Markdown table.

    .venv/bin/python benchmarks/compare_reference.py                 # all 300 images, 4 methods
    .venv/bin/python benchmarks/compare_reference.py --methods rbd,mr --limit 50 --workers 2
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relicv2.saliency.handcrafted import resolve_methods  # noqa: E402
from relicv2.saliency.handcrafted.methods import METHODS  # noqa: E402
from relicv2.saliency.images import read_gray, read_rgb  # noqa: E402
from relicv2.saliency.metrics import aggregate, normalise_prediction, score_image  # noqa: E402
from tests.paths import SHARED_DATA  # noqa: E402

DATA = SHARED_DATA / "pascal-s-dev"
DSR_LAST = 100


def _one(job: tuple[str, Path, Path, Path]) -> tuple[str, float, float, object, object, float]:
    method, image_path, reference_path, mask_path = job
    rgb = read_rgb(image_path)
    start = time.process_time()
    ours = METHODS[method](rgb)
    seconds = time.process_time() - start
    ours8 = np.rint(ours * 255.0)  # score what the CLI would write: an 8-bit map
    reference = read_gray(reference_path).astype(np.float64)
    mask = read_gray(mask_path)
    a, b = normalise_prediction(ours8), normalise_prediction(reference)
    difference = float(np.abs(a - b).mean())
    if a.std() > 0 and b.std() > 0:
        correlation = float(np.corrcoef(a.ravel(), b.ravel())[0, 1])
    else:
        correlation = float("nan")
    return (
        image_path.stem,
        difference,
        correlation,
        score_image(ours8, mask),
        score_image(reference, mask),
        seconds,
    )


def compare(method: str, stems: list[str], workers: int, data: Path = DATA) -> dict[str, object]:
    """Run one method over ``stems`` and collect fidelity and quality figures."""
    jobs = [
        (
            method,
            data / "images" / f"{s}.jpg",
            data / "reference-maps" / method / f"{s}.png",
            data / "masks" / f"{s}.png",
        )
        for s in stems
        if (data / "reference-maps" / method / f"{s}.png").exists()
    ]
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows = list(pool.map(_one, jobs, chunksize=4))
    else:
        rows = [_one(j) for j in jobs]
    ours = aggregate(r[3] for r in rows)
    theirs = aggregate(r[4] for r in rows)
    worst = sorted(rows, key=lambda r: r[1], reverse=True)[:5]
    return {
        "method": method,
        "count": len(rows),
        "difference": float(np.mean([r[1] for r in rows])),
        "correlation": float(np.nanmean([r[2] for r in rows])),
        "ours": ours,
        "reference": theirs,
        "seconds": float(np.mean([r[5] for r in rows])),
        "worst": [(r[0], round(r[1], 3), round(r[2], 3)) for r in worst],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="all")
    parser.add_argument("--limit", type=int, default=300, help="first N images (default 300)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--data", type=Path, default=DATA, help="the pascal-s-dev folder (default: the shared data)")
    args = parser.parse_args()
    if not args.data.is_dir():
        sys.exit(f"PASCAL-S dev data not found at {args.data}; pass --data")
    stems = sorted(p.stem for p in (args.data / "images").glob("*.jpg"))[: args.limit]
    results = []
    for method in resolve_methods(args.methods):
        method_stems = stems[:DSR_LAST] if method == "dsr" else stems
        results.append(compare(method, method_stems, args.workers, args.data))
        r = results[-1]
        print(f"[{method}] done: {r['count']} images, worst |diff| {r['worst']}", file=sys.stderr)
    print(
        "| method | images | mean abs diff | correlation | ours MAE / max-F / adp-F / S "
        "| reference MAE / max-F / adp-F / S | max-F gap | CPU s/img |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        o, t = r["ours"], r["reference"]
        print(
            f"| {r['method']} | {r['count']} | {r['difference']:.3f} | {r['correlation']:.3f} "
            f"| {o.mae:.3f} / {o.max_f:.3f} / {o.adaptive_f:.3f} / {o.s_measure:.3f} "
            f"| {t.mae:.3f} / {t.max_f:.3f} / {t.adaptive_f:.3f} / {t.s_measure:.3f} "
            f"| {o.max_f - t.max_f:+.3f} | {r['seconds']:.3f} |"
        )


if __name__ == "__main__":
    main()

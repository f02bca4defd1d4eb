"""benchmarks/saliency_paper_estimate.py: the work of a `saliency train` preset, counted without running it."""

from __future__ import annotations

from relicv2.saliency.network.config import load_saliency_config
from tests.paths import load_benchmark


def test_counts_every_epochs_pass_and_each_phase_one_crf():
    script = load_benchmark("saliency_paper_estimate")
    tiny = load_saliency_config("tiny")  # 4 methods x 1 round x 2 epochs, 2 fused epochs, 8 images
    assert script.work(tiny) == ((4 * 1 * 2 + 2) * 8, 4 * 1 * 2 * 8)
    paper = load_saliency_config("paper")
    assert script.work(paper) == ((4 * 3 * 25 + 200) * 2500, 4 * 3 * 25 * 2500)


def test_a_training_pass_costs_about_three_forwards_and_grows_with_the_pixels():
    script = load_benchmark("saliency_paper_estimate")
    forward = script.pass_flops(18, 1, 64, train=False)
    assert 2.5 < script.pass_flops(18, 1, 64, train=True) / forward < 3.5
    assert 3.5 < script.pass_flops(18, 1, 128, train=False) / forward < 4.5


def test_prints_the_hours_at_each_rate(capsys):
    script = load_benchmark("saliency_paper_estimate")
    assert script.main(["--config", "tiny", "--gpu-tflops", "1", "--gpu-tflops", "2", "--crf-cpu-ms", "450",
                        "--maps-cpu-s", "450", "--cores", "1"]) == 0
    out = capsys.readouterr().out
    assert "CRFs 64 = 0.0 CPU-h" in out and "maps 60 CPU-min" in out
    assert out.count("h in all") == 2


def test_a_phase_one_epochs_crf_overlaps_the_next_epochs_training():
    script = load_benchmark("saliency_paper_estimate")
    tiny = load_saliency_config("tiny")  # 4 phase I networks x 2 epochs, then 2 fused epochs
    # Training-bound: each network's CRFs hide behind its next epoch, all but its last.
    assert script.hours(tiny, train_epoch_h=1.0, crf_epoch_h=0.5, maps_h=3.0) == 3 + 4 * (1 + 1 + 0.5) + 2
    # CRF-bound: an epoch's training hides behind the CRF before it, all but the network's first.
    assert script.hours(tiny, train_epoch_h=0.5, crf_epoch_h=1.0, maps_h=0.0) == 4 * (0.5 + 1 + 1) + 2 * 0.5

"""The run folder and the run's life: lock, stale temporaries, --fresh, resume checks, signals, checks up front."""

from __future__ import annotations

import functools
import json
import os
import signal

import pytest
import torch
from click.testing import CliRunner

from relicv2.cli.pretrain import run as pretrain_command
from relicv2.jobs.lock import acquire, release
from relicv2.pretrain.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from relicv2.pretrain.config import ConfigError
from relicv2.pretrain.run import run_pretraining
from relicv2.pretrain.stop import PretrainingInterrupted
from tests.pretrain.conftest import RESUME_OPTIONS, quiet_run, tiny_config
from tests.pretrain.test_trainer import logged, tapped

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_second_job_on_the_run_folder_is_refused_naming_the_holder(tmp_path):
    held = acquire(tmp_path / "run", "relicv2 pretrain")  # a live job (this process) holds the folder
    try:
        with pytest.raises(ConfigError, match=r"in use by 'relicv2 pretrain' \(host .*, pid \d+"):
            quiet_run(tiny_config(tmp_path / "run", "run.max_steps=1"))
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    finally:
        release(held)
    quiet_run(tiny_config(tmp_path / "run", "run.max_steps=1"))  # free again: it runs
    assert not (tmp_path / "run" / ".relicv2.lock").exists()  # and released its lock


def test_stale_temporaries_of_a_killed_run_are_removed_and_counted(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    stale = [".checkpoint-000000004.pt.tmp-host-123", ".config.yaml.tmp-host-9", ".metrics.jsonl.tmp-host-9"]
    for name in stale:
        (out / name).write_bytes(b"partial")
    (out / ".notes.txt.tmp-mine").write_text("not the run's")  # someone else's file: left alone
    run_pretraining(tiny_config(out, "run.max_steps=1"))
    assert "removed 3 temporary file(s) left by an interrupted run" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".notes.txt.tmp-mine"]


def test_fresh_moves_a_longer_earlier_run_aside_and_keeps_the_new_run(tmp_path, finished_run):
    out = tmp_path / "run"
    out.mkdir()
    for path in [*list_checkpoints(finished_run), finished_run / "metrics.jsonl"]:
        (out / path.name).write_bytes(path.read_bytes())  # an earlier, longer run (up to step 8)
    result = CliRunner().invoke(pretrain_command, [
        "--config", "demo-cpu", "--fresh", "--output", str(out), *_tiny_cli_options(),
        "--set", "run.max_steps=3", "--set", "run.checkpoint_every=1", "--set", "run.keep_checkpoints=2"])
    assert result.exit_code == 0, result.output
    assert "moved the earlier run's checkpoints and logs to" in result.output
    # rotation touched only this run's files: its own newest two, the old run kept aside
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-000000002.pt", "checkpoint-000000003.pt"]
    assert "last checkpoint " + str(out / "checkpoint-000000003.pt") in result.output
    (aside,) = [p for p in out.iterdir() if p.name.startswith("previous-")]
    assert [p.name for p in list_checkpoints(aside)] == ["checkpoint-000000006.pt", "checkpoint-000000008.pt"]
    assert sorted(logged(out)) == [1, 2, 3]  # the new run's own metrics
    # a plain rerun continues the new run, not the old one
    again = CliRunner().invoke(pretrain_command, [
        "--config", "demo-cpu", "--output", str(out), *_tiny_cli_options(), "--set", "run.max_steps=4"])
    assert again.exit_code == 0 and "at step 3" in again.output, again.output


def _tiny_cli_options() -> list[str]:
    return [arg for option in ("data.source=synthetic", "data.synthetic_images=32", "model.depth=18",
                               "model.hidden_dim=32", "model.out_dim=16", "views.large_views=2",
                               "views.small_views=1", "views.large_size=16", "views.small_size=8",
                               "optim.global_batch=8", "knn.train_shards=", "knn.val_shards=",
                               "run.progress_bar=false", "run.device=cpu", "run.log_every=1")
            for arg in ("--set", option)]


@pytest.mark.parametrize("setting, message", [
    ("run.seed=1", r"run\.seed is 0 there and 1 here.*--set run\.seed=0"),
    ("data.synthetic_images=40", r"data\.synthetic_images is 32 there and 40 here"),
])
def test_resume_with_another_seed_or_data_set_is_refused_naming_the_setting(tmp_path, finished_run, setting,
                                                                             message):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint-000000006.pt").write_bytes((finished_run / "checkpoint-000000006.pt").read_bytes())
    (out / "config.yaml").write_text("the earlier run's config\n")
    with pytest.raises(CheckpointError, match=message):
        quiet_run(tiny_config(out, *RESUME_OPTIONS, setting))
    assert (out / "config.yaml").read_text() == "the earlier run's config\n"  # a failed resume changed nothing


def _signalled(signum: int):
    """The run's generated views; the 3rd batch of the first epoch is delivered together with `signum`."""

    def tap(source, batch):
        if source.epoch == 0 and source.position == 3:
            os.kill(os.getpid(), signum)

    return tapped(tap)


def _cli_with_views(monkeypatch, views) -> None:
    """`relicv2 pretrain` calling the library with the data source `views` (the CLI's one library call)."""
    monkeypatch.setattr("relicv2.pretrain.run.run_pretraining", functools.partial(run_pretraining, views=views))


def test_sigterm_saves_the_current_step_and_the_rerun_continues_exactly(tmp_path, finished_run):
    out = tmp_path / "run"
    with pytest.raises(PretrainingInterrupted, match=r"stopped by SIGTERM at step 3; checkpoint .*checkpoint-000000003"):
        quiet_run(tiny_config(out, *RESUME_OPTIONS), views=_signalled(signal.SIGTERM))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler was put back
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-000000002.pt", "checkpoint-000000003.pt"]
    assert quiet_run(tiny_config(out, *RESUME_OPTIONS)).step == 8
    expected, got = logged(finished_run), logged(out)
    assert [got[s] for s in range(4, 9)] == [expected[s] for s in range(4, 9)]


def test_sigint_saves_then_stops_with_one_line(tmp_path, monkeypatch):
    _cli_with_views(monkeypatch, _signalled(signal.SIGINT))
    result = CliRunner().invoke(pretrain_command, ["--config", "demo-cpu", "--output",
                                                   str(tmp_path / "run"), *_tiny_cli_options()])
    assert result.exit_code == 130
    assert result.output.strip().splitlines()[-1].startswith("stopped by SIGINT at step 3; checkpoint")
    assert load_checkpoint(tmp_path / "run" / "checkpoint-000000003.pt")["step"] == 3


def test_metrics_carry_throughput_and_data_wait(finished_run):
    records = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["images_per_s"] > 0 and 0 <= r["data_wait_s"] < 60 for r in records)


@pytest.mark.parametrize("overrides, message", [
    (["knn.train_shards=missing-train", "knn.val_shards=missing-val"], "knn.train_shards=missing-train: missing-train does not exist"),
    (["data.source=shards", "data.train_shards=no-such-shards"], "data.train_shards=no-such-shards: no-such-shards does not exist"),
    (["data.source=shards", "data.train_shards=t-{0000..0001}.tar"], r"shard file\(s\) not found: t-0000.tar, t-0001.tar"),
    pytest.param(["run.device=cuda"], "no CUDA device is visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")),
])
def test_what_the_run_needs_is_checked_before_any_work(tmp_path, monkeypatch, overrides, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        quiet_run(tiny_config(tmp_path / "run", *overrides))
    assert not (tmp_path / "run").exists()


def test_a_knn_set_without_class_indices_is_refused_before_any_work(tmp_path):
    import io

    import webdataset as wds
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buffer, "JPEG")
    for name, cls in (("unlabelled", None), ("named", b"tench")):
        (tmp_path / name).mkdir()
        with wds.ShardWriter(str(tmp_path / name / "train-%04d.tar"), verbose=0) as sink:
            sink.write({"__key__": "a", "jpg": buffer.getvalue(), **({"cls": cls} if cls else {})})
    for name, says in (("unlabelled", "sample a has no class label"), ("named", "sample a has cls 'tench', not a class index")):
        with pytest.raises(ConfigError, match=f"knn.train_shards=.*{name}: {says}.*knn.train_shards= to turn"):
            quiet_run(tiny_config(tmp_path / "run", f"knn.train_shards={tmp_path / name}",
                                  f"knn.val_shards={tmp_path / name}"))
        assert not (tmp_path / "run").exists()


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "run").write_text("a file")
    with pytest.raises(ConfigError, match="is a file"):
        quiet_run(tiny_config(tmp_path / "run"))


class _TooLarge(torch.Tensor):
    """Views whose concatenation in the step does not fit in memory."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.cat:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_step_out_of_gpu_memory_says_what_to_change(tmp_path, monkeypatch):
    def too_large(source, batch):
        batch["views"] = [view.as_subclass(_TooLarge) for view in batch["views"]]

    _cli_with_views(monkeypatch, tapped(too_large))
    result = CliRunner().invoke(pretrain_command, ["--config", "demo-cpu", "--output",
                                                   str(tmp_path / "run"), *_tiny_cli_options()])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "out of GPU memory in step 1 with 8 images per rank" in result.output
    assert "model.activation_checkpointing=true" in result.output
    assert "views.ready_batches=0" in result.output  # the batches made ahead hold memory too


def test_views_out_of_gpu_memory_say_what_to_change(tmp_path, monkeypatch):
    """Made in the view loader (its thread on a GPU), outside the step: the same one-line error."""

    def out_of_memory(source, batch):  # raised where the source's iterator makes the first batch
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    _cli_with_views(monkeypatch, tapped(out_of_memory))
    result = CliRunner().invoke(pretrain_command, ["--config", "demo-cpu", "--output",
                                                   str(tmp_path / "run"), *_tiny_cli_options()])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "out of GPU memory while making the next batch of views" in result.output
    assert "views.ready_batches=0" in result.output


def test_metrics_truncation_keeps_the_records_up_to_the_resumed_step(tmp_path):
    from relicv2.pretrain.metrics_log import truncate_metrics

    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3, 4)]
    lines.insert(2, json.dumps({"step": 2, "knn_top1": 0.5}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "lo')  # torn by the kill
    assert truncate_metrics(tmp_path, 2) == 3
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}, {"step": 2, "knn_top1": 0.5}]
    assert truncate_metrics(tmp_path, 2) == 0


def test_fresh_and_resume_together_are_refused(tmp_path):
    result = CliRunner().invoke(pretrain_command, ["--config", "demo-cpu", "--fresh",
                                                   "--resume", str(tmp_path / "x.pt")])
    assert result.exit_code == 2 and "give one of them" in result.output


def test_a_run_logged_to_a_file_prints_progress_lines_with_total_and_eta(tmp_path, capfd, monkeypatch):
    # Not a terminal (a SLURM or nohup log): plain lines instead of a redrawn bar, the last at the end.
    import relicv2.jobs.progress

    monkeypatch.setattr(relicv2.jobs.progress, "LINE_EVERY_S", 0.0)
    quiet_run(tiny_config(tmp_path / "run", "run.progress_bar=true", "optim.epochs=1"), auto_resume=False)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("pretrain: step")]
    assert len(lines) == 4 and "\r" not in "".join(lines)
    assert lines[-1].startswith("pretrain: step 4/4 (100%)") and "ETA 0:00:00" in lines[-1] and "loss " in lines[-1]
    assert "ETA" in lines[0] and lines[0].startswith("pretrain: step 1/4 (25%)")


def test_a_resume_compares_shard_sets_as_places_not_as_text(tmp_path, monkeypatch):
    from relicv2.jobs.config import to_dict
    from relicv2.pretrain.config import load_config
    from relicv2.pretrain.resume import check_compatible

    monkeypatch.chdir(tmp_path)
    saved = to_dict(load_config(None, ["data.train_shards=sh/train"]))
    for same in ("sh/train/", "./sh/train", str(tmp_path / "sh" / "train")):
        check_compatible(saved, load_config(None, [f"data.train_shards={same}"]), tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match=r"data\.train_shards is 'sh/train' there and 'sh/val' here"):
        check_compatible(saved, load_config(None, ["data.train_shards=sh/val"]), tmp_path / "c.pt")


def test_resuming_another_runs_checkpoint_into_a_folder_holding_a_run_is_refused(tmp_path, finished_run):
    out = tmp_path / "run"
    quiet_run(tiny_config(out, *RESUME_OPTIONS, "run.max_steps=2"))  # this folder's own run, up to step 2
    before = sorted(p.name for p in out.iterdir())
    config_text = (out / "config.yaml").read_text()
    with pytest.raises(CheckpointError, match=r"is not a checkpoint of .*run, which holds another run \(up to "
                                              r"checkpoint-000000002\.pt\); resume into another --output"):
        quiet_run(tiny_config(out, *RESUME_OPTIONS), resume=finished_run / "checkpoint-000000006.pt")
    assert sorted(p.name for p in out.iterdir()) == before and (out / "config.yaml").read_text() == config_text
    other = tmp_path / "other"  # an empty folder takes another run's checkpoint
    assert quiet_run(tiny_config(other, *RESUME_OPTIONS), resume=finished_run / "checkpoint-000000006.pt").step >= 6


def test_the_folder_keeps_the_config_that_trained_each_stretch_of_steps(tmp_path, capsys):
    from relicv2.pretrain.run import run_pretraining

    out = tmp_path / "run"
    run_pretraining(tiny_config(out, *RESUME_OPTIONS, "run.max_steps=2", "optim.base_lr=4.0"))
    first = (out / "config.yaml").read_text()
    run_pretraining(tiny_config(out, *RESUME_OPTIONS, "run.max_steps=3", "optim.base_lr=1.0"))
    assert "the config that trained steps 1-2 is kept as config-to-step-000000002.yaml" in capsys.readouterr().out
    assert (out / "config-to-step-000000002.yaml").read_text() == first
    assert "base_lr: 1.0" in (out / "config.yaml").read_text()
    latest = (out / "config.yaml").read_text()
    run_pretraining(tiny_config(out, *RESUME_OPTIONS, "run.max_steps=3", "optim.base_lr=2.0"))  # finished: no step
    assert "the run is finished at step 3: nothing to train" in capsys.readouterr().out
    assert (out / "config.yaml").read_text() == latest  # still the settings that made its steps
    run_pretraining(tiny_config(out, *RESUME_OPTIONS, "run.max_steps=3", "optim.base_lr=1.0"), fresh=True)
    (aside,) = [p for p in out.iterdir() if p.name.startswith("previous-")]
    assert (aside / "config-to-step-000000002.yaml").is_file() and not list(out.glob("config-to-step-*"))


def test_a_run_refused_at_start_leaves_no_empty_folder(tmp_path):
    from relicv2.shards import ShardSample, write_shard_set
    from tests.pretrain.views.test_sources import encoded

    write_shard_set([ShardSample(f"k{i}", {"jpg": encoded(i, "JPEG")}, None, {}) for i in range(3)], tmp_path / "few")
    out = tmp_path / "runs" / "refused"
    with pytest.raises(ConfigError, match="fewer than one batch"):
        quiet_run(tiny_config(out, "data.source=shards", f"data.train_shards={tmp_path / 'few'}"))
    assert not (tmp_path / "runs").exists()  # the folders it created are gone again


def test_a_full_disk_is_one_line_naming_the_checkpoint_and_no_space_left(tmp_path, monkeypatch):
    from tests.models.test_torchfile import fill_the_disk

    fill_the_disk(monkeypatch)
    with pytest.raises(ConfigError) as raised:
        quiet_run(tiny_config(tmp_path / "run", "run.max_steps=3"))
    message = str(raised.value)
    assert f"cannot write checkpoint {tmp_path / 'run'}" in message and "No space left on device" in message
    assert "inline_container" not in message and "\n" not in message and "rerun to resume" in message

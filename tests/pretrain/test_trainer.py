"""The trainer end to end on generated data: learning, exact resume, non-finite losses, checkpoints, CLI."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from relicv2.cli.pretrain import run as pretrain_command
from relicv2.pretrain.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from relicv2.pretrain.config import derive
from relicv2.pretrain.distributed import describe_environment
from relicv2.pretrain.run import build_view_source
from relicv2.pretrain.trainer import (
    NonFiniteLossError,
    StepSettings,
    build_state,
    train_step,
    wrap_networks,
)
from relicv2.pretrain.views.source import ViewSource
from relicv2.pretrain.views.synthetic import SyntheticViews
from tests.paths import CONFIGS
from tests.pretrain.conftest import RESUME_OPTIONS, quiet_run, tiny_config
from tests.threads import one_torch_thread


def logged(out: Path, name: str = "loss") -> dict[int, float]:
    """step -> metric from metrics.jsonl (a resumed run's later records win)."""
    values = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if name in record:
            values[record["step"]] = record[name]
    return values


@pytest.mark.slow
def test_fifty_steps_on_generated_data_lower_the_loss(tmp_path):
    config = tiny_config(
        tmp_path, "data.synthetic_images=64",
        "optim.epochs=7", "run.max_steps=50", "optim.base_lr=2.0", "optim.ema_base=0.99",
        "loss.num_negatives=7", "loss.contrast_weight=1.0", "loss.invariance_weight=1.0",
        "run.checkpoint_every=1000",
    )
    result = quiet_run(config, auto_resume=False)
    assert result.step == 50 and result.skipped_steps == 0
    loss, contrastive = logged(tmp_path, "loss"), logged(tmp_path, "contrastive")
    assert sorted(loss) == list(range(1, 51))
    first = sum(loss[s] for s in range(1, 6)) / 5
    last = sum(loss[s] for s in range(46, 51)) / 5
    assert last < first - 0.2, (first, last)
    # the instance-discrimination term itself improves, not only the invariance term
    assert sum(contrastive[s] for s in range(46, 51)) / 5 < sum(contrastive[s] for s in range(1, 6)) / 5 - 0.05
    # the schedule ran: warmup to the peak, then cosine decay
    lrs = logged(tmp_path, "lr")
    assert lrs[1] == 0.0 and max(lrs.values()) == pytest.approx(2.0 * 8 / 256, rel=0.05)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_kill_and_resume_equals_an_uninterrupted_run(tmp_path, finished_run):
    killed = tmp_path / "killed"
    quiet_run(tiny_config(killed, *RESUME_OPTIONS, "run.max_steps=5"), auto_resume=False)  # saves 2, 4, 5
    # The job "dies" after step 5 but before its step-5 checkpoint reached the disk.
    (killed / "checkpoint-000000005.pt").unlink()
    resumed = quiet_run(tiny_config(killed, *RESUME_OPTIONS))  # automatic resume from checkpoint 4
    assert resumed.step == 8
    expected, got = logged(finished_run), logged(killed)
    # the records the killed run wrote after its checkpoint were dropped on resume: one per step
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    assert sorted(got) == list(range(1, 9))
    for step in range(5, 9):  # every step after the resume point, bit for bit on CPU
        assert got[step] == expected[step], step
    a = load_checkpoint(finished_run / "checkpoint-000000008.pt")
    b = load_checkpoint(killed / "checkpoint-000000008.pt")
    for name in ("online", "target"):
        for key, value in a[name].items():
            assert torch.equal(value, b[name][key]), (name, key)
    assert a["data"] == b["data"]


def test_checkpoint_contents_and_rotation(finished_run):
    files = list_checkpoints(finished_run)
    assert [p.name for p in files] == ["checkpoint-000000006.pt", "checkpoint-000000008.pt"]
    assert not [p for p in finished_run.iterdir() if p.name.startswith(".")]  # no temporary files left
    payload = load_checkpoint(files[-1])
    assert payload["step"] == 8 and payload["config"]["optim"]["global_batch"] == 8
    assert payload["data"] == [{"epoch": 1, "position": 4}]
    assert set(payload["rng"][0]) == {"torch", "cuda"}
    assert "encoder.conv1.weight" in payload["online"] and "predictor.linear1.weight" in payload["online"]
    assert "predictor.linear1.weight" not in payload["target"]
    assert (finished_run / "config.yaml").read_text().startswith("version:")


def test_foreign_and_corrupt_checkpoints_give_one_clear_error(tmp_path, finished_run):
    real = finished_run / "checkpoint-000000008.pt"

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(real.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=r"truncated\.pt is not a readable relicv2 pretraining checkpoint"):
        load_checkpoint(truncated)

    foreign = tmp_path / "torchvision.pt"
    torch.save({"conv1.weight": torch.zeros(1)}, foreign)
    with pytest.raises(CheckpointError, match=r"torchvision\.pt is not a relicv2 pretraining checkpoint"):
        load_checkpoint(foreign)

    pickled = tmp_path / "pickled.pt"
    torch.save({"format": "relicv2-pretrain-checkpoint", "evil": Path("/")}, pickled)  # not weights-only
    with pytest.raises(CheckpointError, match="not a readable"):
        load_checkpoint(pickled)

    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")

    # automatic resume meets a corrupt newest file: the error names it, nothing trains
    corrupt_run = tmp_path / "corrupt"
    corrupt_run.mkdir()
    (corrupt_run / "checkpoint-000000009.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"checkpoint-000000009\.pt is not a readable"):
        quiet_run(tiny_config(corrupt_run))
    assert not (corrupt_run / "metrics.jsonl").exists()

    # a checkpoint of another architecture
    with pytest.raises(CheckpointError, match="does not fit this run's networks"):
        quiet_run(tiny_config(tmp_path / "other", "model.hidden_dim=64"), resume=real)


def test_save_checkpoint_is_atomic_and_refuses_incomplete_payloads(tmp_path):
    with pytest.raises(ValueError, match="lacks"):
        save_checkpoint(tmp_path, {"step": 1}, keep=1)
    assert list(tmp_path.iterdir()) == []


class _Tapped:
    """The run's own data source; `tap(source, batch)` sees each batch before the step gets it."""

    def __init__(self, source: ViewSource, tap: Callable[[ViewSource, dict], None]) -> None:
        self.source, self.tap = source, tap

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self):
        for batch in self.source:
            self.tap(self.source, batch)
            yield batch


def tapped(tap: Callable[[ViewSource, dict], None]):
    """A `run_pretraining(views=...)` factory: the config's own data source, tapped."""
    return lambda config, ctx, shards: _Tapped(build_view_source(config, ctx, shards), tap)


def _poison_the_fourth_batch(source, batch):
    if source.epoch == 0 and source.position == 4:
        batch["views"][0][0, 0, 0, 0] = float("nan")


def test_nonfinite_loss_stops_naming_the_step_and_last_checkpoint(tmp_path):
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 4; last good checkpoint: .*checkpoint-000000003\.pt"):
        quiet_run(tiny_config(tmp_path), auto_resume=False, views=tapped(_poison_the_fourth_batch))


def test_nonfinite_loss_can_be_skipped_and_counted(tmp_path):
    result = quiet_run(tiny_config(tmp_path, "run.on_nonfinite=skip", "run.max_steps=4",
                                    "run.checkpoint_every=1000"), auto_resume=False,
                       views=tapped(_poison_the_fourth_batch))
    assert result.step == 4 and result.skipped_steps == 1
    skipped = logged(tmp_path, "skipped")
    assert [s for s, v in skipped.items() if v] == [4]
    assert load_checkpoint(tmp_path / "checkpoint-000000004.pt")["skipped_steps"] == 1


def test_a_skipped_step_leaves_the_weights_untouched(tmp_path):
    config = tiny_config(tmp_path, "run.on_nonfinite=skip")
    ctx = describe_environment("cpu", env={})
    source = SyntheticViews(32, 8, large_views=2, small_views=1, large_size=16, small_size=8)
    derived = derive(config, world_size=1, dataset_size=32)
    settings = StepSettings.from_config(config, derived, ctx)
    state = build_state(config, ctx, settings)
    online_forward, target_forward = wrap_networks(state, ctx)
    views = next(iter(source))["views"]
    before = {k: v.clone() for k, v in state.online.state_dict().items()}
    views[1][2, 1, 3, 3] = float("inf")
    metrics = train_step(state, views, online_forward=online_forward, target_forward=target_forward,
                         settings=settings, ctx=ctx)
    assert metrics["skipped"] == 1.0 and state.step == 1 and state.skipped_steps == 1
    for key, value in state.online.state_dict().items():
        if not key.endswith(("running_mean", "running_var", "num_batches_tracked")):
            assert torch.equal(value, before[key]), key


def test_train_state_round_trips_through_its_state_dict_with_the_rng(tmp_path):
    config = tiny_config(tmp_path)
    ctx = describe_environment("cpu", env={})
    batches = iter(SyntheticViews(32, 8, large_views=2, small_views=1, large_size=16, small_size=8))
    settings = StepSettings.from_config(config, derive(config, world_size=1, dataset_size=32), ctx)
    state = build_state(config, ctx, settings)
    online_forward, target_forward = wrap_networks(state, ctx)

    def step() -> None:
        train_step(state, next(batches)["views"], online_forward=online_forward, target_forward=target_forward,
                   settings=settings, ctx=ctx)

    step()  # momentum in the optimizer, a moved target
    saved = copy.deepcopy(state.state_dict())  # the live tensors move on with the next step
    expected_draws = torch.rand(4)
    step()
    torch.rand(7)
    restored = build_state(config, ctx, settings)  # fresh networks; build_state re-seeds the RNG too
    restored.load_state_dict(saved)
    assert torch.equal(torch.rand(4), expected_draws)  # the next random draws are the saved run's
    assert (restored.step, restored.skipped_steps) == (1, 0)
    again = restored.state_dict()
    for name in ("online", "target"):
        assert all(torch.equal(value, again[name][key]) for key, value in saved[name].items()), name
    assert again["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]
    momentum = saved["optimizer"]["state"]
    assert momentum and all(torch.equal(buffer, again["optimizer"]["state"][index][key])
                            for index, buffers in momentum.items() for key, buffer in buffers.items())


def test_cli_pretrain_runs_the_demo_preset_on_generated_data(tmp_path):
    out = tmp_path / "demo"
    args = ["--config", str(CONFIGS / "demo-cpu.yaml"),
            "--set", "data.source=synthetic", "--set", "data.synthetic_images=64",
            "--set", "views.large_size=16", "--set", "views.small_size=8", "--set", "model.hidden_dim=32",
            "--set", "knn.train_shards=", "--set", "knn.val_shards=",
            "--set", "run.max_steps=2", "--set", "run.progress_bar=false", "--output", str(out)]
    result = CliRunner().invoke(pretrain_command, args)
    assert result.exit_code == 0, result.output
    optim = yaml.safe_load((CONFIGS / "demo-cpu.yaml").read_text())["optim"]
    steps = optim["epochs"] * 64 // optim["global_batch"]  # the schedule's length, read from the preset
    assert "peak_lr:" in result.output and f"total_steps: {steps}" in result.output
    assert (out / "checkpoint-000000002.pt").is_file()
    bad = CliRunner().invoke(pretrain_command, ["--config", args[1], "--set", "optim.base_rate=1"])
    assert bad.exit_code != 0 and "unknown key optim.base_rate" in bad.output


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """A plain 3-step run (eager, activations stored), what the variants below must train like."""
    out = tmp_path_factory.mktemp("plain")
    with one_torch_thread():
        quiet_run(tiny_config(out, "run.max_steps=3"), auto_resume=False)
    return out


@pytest.mark.slow
def test_compiled_networks_train_like_eager_ones(tmp_path, plain):
    # run.compile=true goes through torch.compile: dynamo captures the online and target networks
    # and AOTAutograd the backward, as on a GPU. The aot_eager backend stops short of inductor's
    # code generation, which costs ~100 s of C++ compilation on a CPU; inductor itself is tested
    # on the GPU (test_gpu.py), where run.compile is on by default.
    compiled = tmp_path / "compiled"
    quiet_run(tiny_config(compiled, "run.max_steps=3", "run.compile=true", "run.compile_backend=aot_eager"),
              auto_resume=False)
    assert sorted(logged(compiled)) == [1, 2, 3]
    assert list(logged(compiled).values()) == pytest.approx(list(logged(plain).values()), rel=1e-4)


def test_activation_checkpointing_trains_exactly_like_storing_activations(tmp_path, plain):
    checkpointed = tmp_path / "checkpointed"
    quiet_run(tiny_config(checkpointed, "run.max_steps=3", "model.activation_checkpointing=true"), auto_resume=False)
    assert list(logged(checkpointed).values()) == pytest.approx(list(logged(plain).values()), rel=1e-5)
    a = load_checkpoint(plain / "checkpoint-000000003.pt")
    b = load_checkpoint(checkpointed / "checkpoint-000000003.pt")
    # BatchNorm running statistics are updated once per step, not again by the recomputation
    for key, value in a["online"].items():
        torch.testing.assert_close(b["online"][key], value, rtol=1e-4, atol=1e-6, msg=key)

"""Every command of docs/guide.md's ```bash blocks, run or checked, so the guide cannot drift from the CLI.

The blocks are parsed (`\\` continuations joined, comments dropped) and every command is accounted for; a
command this module cannot classify fails `test_every_guide_command_is_accounted_for`.

- **Run for real**, in the guide's order, in one working folder, at a tiny scale (paths from SUBSTITUTIONS,
  sizes shrunk by the options of SHRINK appended to the command as written): `relicv2 --help`; the whole
  bootstrap of "Your own images" (shards build x2, pretrain without masks, saliency train --config cpu on that
  backbone, build-masks, saliency preview, pretrain with masks, eval linear of the run and of a random-init
  encoder); the ImageNet shards (build train and val, verify); the ImageNet evaluations (`docker/torchrun.sh
  eval linear --config paper | fast`, `eval knn`: the launcher's dry run, then the job in one process); export
  and report.
- **Validated only** (click parses every option, argument and choice; the job's own config resolution runs:
  `pretrain --print-config`, the saliency and linear-eval presets with their `--set` overrides; a launcher runs
  its own `--dry-run` and must hand the job's arguments through unchanged; a `docker run` must mount every
  absolute path its job names): `saliency train --config paper` (a SwAV ResNet-50 w2 file and hours on a GPU),
  every `docker run` and `sbatch docker/slurm.sbatch` line (ResNet-50 pretraining, build-masks on the GPUs),
  and the launchers' `--dry-run` examples, which run nothing as written.
- **Not run**, with the reason: the set-up lines of NOT_RUN (make, docker build).

The ImageNet pretraining and build-masks are validated only, so the ImageNet export and report read the
bootstrap's masked run and mask shards instead (two entries of SUBSTITUTIONS).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from relicv2.cli.main import cli
from tests.paths import REPO
from tests.slurm import fake_scontrol

GUIDE = REPO / "docs" / "guide.md"
TORCHRUN = REPO / "docker" / "torchrun.sh"
SBATCH = REPO / "docker" / "slurm.sbatch"

# Set-up lines that are listed, not run, and why.
NOT_RUN = {
    "make setup": "builds the virtual environment these tests already run in",
    "make test": "runs the whole test suite, this module included",
    "make demo": "the demo on the built-in images: tests/e2e/test_demo.py runs its reduced form",
    "make demo DATA=/path/to/images": "the same demo script on the user's images (DEMO_DATA), as `make demo`",
    "docker build -f docker/Dockerfile -t relicv2 .": "builds the GPU image (minutes, needs Docker); "
                                                     "tests/docker/test_docker.py checks the Dockerfile",
    **dict.fromkeys(("python benchmarks/masking_effect.py --out runs/masking-effect --saliency-set threads=2",
                     "python benchmarks/masking_effect.py --out runs/masking-effect --saliency-set threads=2 "
                     "--seeds 0,1,2,3,4"),
                    "the masking evidence grid (hours on 2 cores, on Imagenette-112); tests/test_masking_effect.py "
                    "checks its arms, random masks, pairing, bootstrap and resume"),
}

# Paths of the guide -> paths in the test's working folder (relative: the commands run from that folder).
# The longest match wins. The guide's own relative paths (my-images/, shards/, runs/) are kept as written.
SUBSTITUTIONS = {
    # ImageNet's build-masks and pretraining are validated only: the bootstrap's outputs stand in for theirs.
    "/data/shards/masked-train": "shards/masked-train",
    "/runs/r50-1000ep": "runs/masked",
    "/data/": "data/",  # data/imagenet/{train,val}: the demo images, as my-images/
    "/runs/": "runs/",
    "/weights/": "weights/",
}

# Options appended to a command run for real (the last value of an option wins in click; `--set`s apply in
# order), keyed by the command's path. Every command run for real has an entry, empty where no size applies.
_PRETRAIN_SIZES = ["run.max_steps=2", "optim.global_batch=8", "loss.num_negatives=7", "optim.warmup_epochs=0",
                   "views.large_size=32", "views.small_size=16", "views.blur_kernel=3", "views.num_threads=1",
                   "model.hidden_dim=64", "model.out_dim=32", "knn.crop_size=32", "knn.resize_size=32",
                   "run.progress_bar=false"]
_SALIENCY_SIZES = ["num_images=4", "input_size=32", "iterations=1", "epochs=1", "fuse_epochs=1", "batch_size=4",
                   "workers=1"]
SHRINK: dict[tuple[str, ...], list[str]] = {
    (): [],  # relicv2 --help
    ("shards", "build"): ["--max-count", "8", "--workers", "1", "--no-progress"],
    ("shards", "verify"): ["--workers", "1", "--no-progress"],
    ("pretrain", "run"): [word for value in _PRETRAIN_SIZES for word in ("--set", value)],
    ("saliency", "train"): [*(word for value in _SALIENCY_SIZES for word in ("--set", value)), "--no-progress"],
    ("saliency", "build-masks"): ["--workers", "0", "--batch", "8", "--no-progress"],
    ("saliency", "preview"): ["--count", "2"],
    ("eval", "linear"): ["--set", "crop_size=32", "--set", "resize_size=32", "--set", "epochs=2",
                         "--set", "feature_batch=16"],
    ("eval", "knn"): ["--crop-size", "32", "--resize-size", "32"],
    ("eval", "robustness"): ["--set", "corruptions=gaussian_noise", "--set", "severities=1", "--set", "workers=1",
                             "--set", "batch_size=16"],
    ("eval", "transfer"): [word for value in ("crop_size=32", "resize_size=32", "l2_points=3", "feature_batch=16",
                                              "epochs=1", "batch_size=8", "learning_rates=0.01", "weight_decays=0",
                                              "workers=0") for word in ("--set", value)],
    ("export",): [],
    ("report",): ["--count", "2"],
}

# Commands the guide runs directly that are validated only: (command path, preset) -> why.
VALIDATED_ONLY = {
    (("saliency", "train"), "paper"): "the paper's settings need a SwAV ResNet-50 w2 file and hours on a GPU",
    **{(("eval", "segment"), preset): "needs a labelled segmentation set (VOC, Cityscapes, a folder of pairs) this "
                                      "test does not have; tests/evaluation/test_segment.py runs the command on "
                                      "crafted pairs" for preset in (None, "cityscapes", "fast")},
    (("eval", "backgrounds"), None): "the masks of this test's few-step saliency network may leave every image out; "
                                     "tests/evaluation/test_background_eval.py runs the command on crafted masks",
}


@dataclass
class GuideCommand:
    """One command of a ```bash block, as written (continuations joined)."""

    block: int  # the ```bash block's number, from 0
    line: int  # of the guide, where the command starts
    text: str
    words: list[str]


@dataclass
class Step:
    """How the test handles a command: the relicv2 arguments and the launcher they go through, if any."""

    command: GuideCommand
    args: list[str] = field(default_factory=list)  # relicv2 ARGS
    launcher: str | None = None  # "torchrun", "slurm", "docker" or "docker+torchrun"
    dry_run: bool = False  # the guide's command is itself a launcher's --dry-run
    launcher_env: dict[str, str] = field(default_factory=dict)
    mounts: list[str] = field(default_factory=list)  # docker run -v targets
    not_run: str | None = None  # the reason


def guide_commands(text: str) -> list[GuideCommand]:
    """The commands of every ```bash block: `\\`-continued lines joined, comments and blank lines dropped."""
    commands = []
    for number_of_block, block in enumerate(re.finditer(r"^```bash\n(.*?)^```", text, re.M | re.S)):
        first_line = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).split("\n")
        number = 0
        while number < len(lines):
            start, joined = number, lines[number]
            while joined.endswith("\\"):
                number += 1
                joined = joined[:-1] + " " + lines[number].strip()
            number += 1
            words = shlex.split(joined, comments=True)
            if words:
                text_as_written = " ".join(joined.split(" #")[0].split())
                commands.append(GuideCommand(number_of_block, first_line + start, text_as_written, words))
    return commands


# `docker run` options that take a value as the next word.
_DOCKER_VALUE_OPTIONS = {"--gpus", "-v", "--volume", "-e", "--env", "--shm-size", "-u", "--user", "-w", "--workdir",
                         "--name", "--entrypoint", "--network"}


def classify(command: GuideCommand) -> Step:
    """What kind of command this is; AssertionError naming the guide line for one this module does not know."""
    words = list(command.words)
    where = f"docs/guide.md:{command.line}: `{command.text}`"
    if command.text in NOT_RUN:
        return Step(command, not_run=NOT_RUN[command.text])
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    head = words[0] if words else ""
    if head in ("relicv2", ".venv/bin/relicv2") and not env:
        return Step(command, args=words[1:])
    if words[:3] == ["python", "-m", "relicv2"] and not env:
        return Step(command, args=words[3:])
    if words[:2] == ["docker", "run"]:
        rest, mounts = words[2:], []
        while rest and rest[0].startswith("-"):
            option = rest.pop(0)
            if option in _DOCKER_VALUE_OPTIONS:
                value = rest.pop(0)
                if option in ("-v", "--volume"):
                    mounts.append(value.split(":")[1])
        assert rest and rest[0] == "relicv2", f"{where}: a docker run of another image than relicv2"
        if rest[1:2] == ["torchrun.sh"]:
            return Step(command, args=rest[2:], launcher="docker+torchrun", mounts=mounts)
        assert rest[1:2] not in (["slurm.sbatch"], ["bash"]), f"{where}: no rule for this entrypoint yet"
        return Step(command, args=rest[1:], launcher="docker", mounts=mounts)
    if head == "sbatch":
        rest = words[1:]
        while rest and rest[0].startswith("--"):
            rest.pop(0)
        words, head = rest, rest[0] if rest else ""
    if head in ("docker/torchrun.sh", "docker/slurm.sbatch"):
        args, dry_run = words[1:], words[1:2] == ["--dry-run"]
        return Step(command, args=args[dry_run:], launcher="torchrun" if head.endswith(".sh") else "slurm",
                    launcher_env=env, dry_run=dry_run)
    raise AssertionError(f"{where}: not a command this test knows how to run or check; add a rule "
                         "(run, validate) or, for a set-up line, an entry of NOT_RUN with the reason")


def substitute(words: list[str]) -> list[str]:
    """The words with the guide's paths replaced by SUBSTITUTIONS (also inside `--set key=/path`)."""
    pattern = re.compile("|".join(re.escape(key) for key in sorted(SUBSTITUTIONS, key=len, reverse=True)))
    return [pattern.sub(lambda match: SUBSTITUTIONS[match.group(0)], word) for word in words]


def resolve(args: list[str], *, names_only: bool = False) -> tuple[tuple[str, ...], click.Context | None]:
    """Parse relicv2 ARGS with click down to the command that would run (every option, argument and choice
    checked, nothing run); return that command's path and its context (None for a `--help`, which click
    answers while parsing). `names_only`: find the command without checking the values (files may not exist yet)."""
    path: list[str] = []
    try:
        ctx = cli.make_context("relicv2", list(args), resilient_parsing=names_only)
        command: click.Command = cli
        while isinstance(command, click.Group):
            # click 8 keeps the sub-command's name apart from the remaining arguments
            rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
            if not rest:  # `relicv2 --help` parsed with names_only: the group itself
                break
            asked = rest[0]
            name, command, rest = command.resolve_command(ctx, rest)
            if command is None:  # resolve_command says so itself unless names_only
                raise click.UsageError(f"no such command: relicv2 {' '.join([*path, asked])}")
            path.append(name)
            ctx = command.make_context(name, rest, parent=ctx, resilient_parsing=names_only)
    except click.exceptions.Exit as shown:
        assert shown.exit_code == 0 and args[-1] in ("--help", "-h"), args
        return tuple(path), None
    return tuple(path), ctx


def _preset(ctx: click.Context | None) -> str | None:
    if ctx is None:
        return None
    return ctx.params.get("config_name") or ctx.params.get("preset_name")


def _invoke(args: list[str]) -> str:
    result = CliRunner().invoke(cli, args, prog_name="relicv2")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, f"relicv2 {shlex.join(args)} exited {result.exit_code}:\n{result.output[-3000:]}"
    return result.output


def runs_for_real(step: Step, path: tuple[str, ...], ctx: click.Context | None) -> bool:
    """Direct commands and torchrun.sh lines (after their dry run, in one process) run, unless expensive;
    docker run and sbatch lines are cluster jobs, and a --dry-run as written runs nothing."""
    if step.not_run is not None or (path, _preset(ctx)) in VALIDATED_ONLY:
        return False
    return step.launcher is None or step.launcher == "torchrun" and not step.dry_run


def validate(step: Step, tmp_path: Path) -> None:
    """Check a command without running its job: click's parse, the job's config resolution, the launcher's dry run."""
    args = substitute(step.args)
    path, ctx = resolve(args)
    if path == ("pretrain", "run"):
        assert "model:" in _invoke([*args, "--print-config"])
    elif path == ("saliency", "train"):
        from relicv2.saliency.network.config import load_saliency_config

        load_saliency_config(_preset(ctx), ctx.params["overrides"])
    elif path == ("eval", "linear") and _preset(ctx) is not None:
        from relicv2.evaluation.job import load_linear_config

        load_linear_config(_preset(ctx), ctx.params["overrides"])
    elif path == ("eval", "segment"):
        from relicv2.evaluation.segment import load_segment_config

        load_segment_config(_preset(ctx) or "paper", ctx.params["overrides"])
    if step.launcher in ("docker", "docker+torchrun"):
        named = [part for word in step.args for part in re.findall(r"(?:^|=)(/[^\s,]+)", word)]
        unmounted = [name for name in named if not any(name.startswith(m.rstrip("/") + "/") for m in step.mounts)]
        assert not unmounted, f"docs/guide.md:{step.command.line}: {unmounted} not mounted (-v) in the container"
    if step.launcher in ("torchrun", "slurm", "docker+torchrun"):
        _dry_run(step, tmp_path)


def _dry_run(step: Step, tmp_path: Path) -> None:
    """The launcher's own --dry-run must succeed and pass the job's arguments through unchanged."""
    env = dict(os.environ, PYTHON=sys.executable, **step.launcher_env)
    if step.launcher == "slurm":
        env["PATH"] = f"{fake_scontrol(tmp_path / 'bin')}:{env['PATH']}"
        env.setdefault("SLURM_JOB_NODELIST", "gpu[01-02]")
        script = SBATCH
    else:
        script = TORCHRUN
    result = subprocess.run([str(script), "--dry-run", *step.args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, f"docs/guide.md:{step.command.line}: {result.stderr}"
    launched = next(line for line in result.stdout.splitlines() if "torch.distributed.run" in line)
    assert shlex.split(launched)[-len(step.args) - 2:] == ["-m", "relicv2", *step.args]


def _steps() -> list[Step]:
    return [classify(command) for command in guide_commands(GUIDE.read_text())]


def test_every_guide_command_is_accounted_for():
    steps = _steps()
    text = GUIDE.read_text()
    blocks = len(re.findall(r"^```bash$", text, re.M))
    assert blocks >= 10 and {step.command.block for step in steps} == set(range(blocks))  # no block left out
    # every section that has command blocks is covered, the ImageNet workflow included
    workflow = text.index("## The ImageNet workflow")
    assert sum(text.count("\n", 0, workflow) < step.command.line for step in steps) >= 10
    for step in steps:
        if step.not_run is None:
            path, ctx = resolve(substitute(step.args), names_only=True)
            if runs_for_real(step, path, ctx):
                assert path in SHRINK, f"docs/guide.md:{step.command.line}: no SHRINK entry for `relicv2 {' '.join(path)}`"
    assert set(NOT_RUN) <= {step.command.text for step in steps}, "NOT_RUN names a command the guide no longer has"


def test_the_parser_joins_continuations_and_drops_comments():
    text = "x\n```bash\n# a comment\nrelicv2 a \\\n    --b c   # trailing\n\nmake d\n```\n```python\nno\n```\n"
    commands = guide_commands(text)
    assert [(c.block, c.line, c.text, c.words) for c in commands] == [
        (0, 4, "relicv2 a --b c", ["relicv2", "a", "--b", "c"]), (0, 7, "make d", ["make", "d"])]
    with pytest.raises(AssertionError, match="not a command this test knows"):
        classify(GuideCommand(0, 1, "curl x", ["curl", "x"]))
    with pytest.raises(click.UsageError, match="no such command: relicv2 shards bild"):
        resolve(["shards", "bild", "a", "b"], names_only=True)


def test_a_wrong_option_in_the_guide_would_fail():
    with pytest.raises(click.UsageError, match="--worker"):
        resolve(["shards", "build", "a", "b", "--worker", "6"])
    with pytest.raises(AssertionError, match="unknown preset 'no-such-preset'"):
        _invoke(["pretrain", "--config", "no-such-preset", "--print-config"])


def _validated_only() -> list[Step]:
    """The steps that are checked but not run (an unclassified command is left to the accounting test)."""
    steps = []
    for command in guide_commands(GUIDE.read_text()):
        try:
            step = classify(command)
        except AssertionError:
            continue
        if step.not_run is None and not runs_for_real(step, *resolve(substitute(step.args), names_only=True)):
            steps.append(step)
    return steps


_VALIDATED = _validated_only()


@pytest.mark.parametrize("step", _VALIDATED, ids=[f"line{step.command.line}" for step in _VALIDATED])
def test_guide_command_is_valid(step: Step, tmp_path: Path):
    validate(step, tmp_path)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # and restores torch's thread count, which the jobs set in this process
def test_guide_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # the user's images and ImageNet: the demo images (8 classes), generated, never downloaded
    _invoke(["demo-data", "data/imagenet", "--train-per-class", "2", "--val-per-class", "1", "--size", "64"])
    Path("my-images").symlink_to(tmp_path / "data" / "imagenet")
    ran = []
    for step in _steps():
        args = substitute(step.args)
        path, ctx = resolve(args, names_only=True)
        if not runs_for_real(step, path, ctx):
            continue
        if step.launcher == "torchrun":
            _dry_run(step, tmp_path)
        started = time.monotonic()
        _invoke([*args, *SHRINK[path]])
        ran.append(step.command.text)
        print(f"{time.monotonic() - started:6.1f} s  {step.command.text}")
    # what the guide's commands wrote, where the guide says they write it
    assert sorted(Path("runs/plain").glob("checkpoint-*.pt")) and sorted(Path("runs/masked").glob("checkpoint-*.pt"))
    assert Path("runs/saliency/model.pt").is_file() and Path("masks.png").is_file()
    assert (Path("shards/masked-train") / "manifest.parquet").is_file()
    for name in ("linear-paper", "linear-fast", "knn"):
        assert (Path("runs/masked/eval") / f"{name}.json").is_file()
    assert Path("runs/masked/resnet50.pt").is_file() and Path("runs/masked/report.html").is_file()
    assert all(Path(f"runs/masked/{name}/transfer.json").is_file() for name in ("transfer", "transfer-finetune"))
    assert len(ran) >= 17, ran

"""A stand-in `scontrol` for dry runs of docker/slurm.sbatch on a machine without SLURM."""

from __future__ import annotations

from pathlib import Path

# Expands a bracketed node list ("gpu[07-10]") as `scontrol show hostnames` does.
_SCONTROL = (
    "#!/usr/bin/env python3\n"
    "import re, sys\n"
    "assert sys.argv[1:3] == ['show', 'hostnames'], sys.argv\n"
    "m = re.fullmatch(r'(\\w+)\\[(\\d+)-(\\d+)\\]', sys.argv[3])\n"
    "width = len(m.group(2))\n"
    "for i in range(int(m.group(2)), int(m.group(3)) + 1):\n"
    "    print(f'{m.group(1)}{i:0{width}d}')\n"
)


def fake_scontrol(bin_dir: Path) -> Path:
    """Write an executable `scontrol` into `bin_dir` (put it first on PATH) and return the folder."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(_SCONTROL)
    scontrol.chmod(0o755)
    return bin_dir

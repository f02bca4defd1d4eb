"""What a process pays for at start: the heavy libraries stay out of the jobs that do not use them.

Every command and every test that starts one runs in a fresh interpreter, so an import at the top of a module
costs its CPU in each of them: torchvision imports its detection ops and with them torch._dynamo (more CPU than
torch itself), the handcrafted methods numba, scipy and OpenCV, the report's figures matplotlib.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.paths import REPO

# (modules a job imports, libraries it must not have imported), in one interpreter from the lightest step to the
# heaviest, so each step's list also holds for the steps before it.
STEPS = [
    # the saliency commands and their settings name the handcrafted methods without importing them
    (["relicv2.cli.saliency", "relicv2.saliency.network.config"],
     ["relicv2.saliency.handcrafted.methods", "numba", "scipy", "skimage", "torch"]),
    # build-masks (a network's inference), the files of the networks and the architecture table: torchvision
    # only where a network is built
    (["relicv2.saliency.network.build_masks", "relicv2.models.checkpoint_file", "relicv2.models.encoder_file",
      "relicv2.models.official"],
     ["torchvision", "torch._dynamo", "relicv2.saliency.handcrafted.methods", "numba", "matplotlib"]),
    # pretraining and evaluation: the report's figures and DALI only where they are drawn or run
    (["relicv2.pretrain.run", "relicv2.evaluation.job", "relicv2.evaluation.report.inputs"],
     ["matplotlib", "nvidia.dali", "skimage"]),
]

PROBE = """
import importlib, json, sys
found = []
for modules, kept_out in json.loads(sys.argv[1]):
    for module in modules:
        importlib.import_module(module)
    found.append(sorted(name for name in kept_out if name in sys.modules))
print(json.dumps(found))
"""


@pytest.mark.slow
def test_each_job_imports_only_the_libraries_it_uses():
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(STEPS)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    leaks = {modules[0]: imported for (modules, _), imported in zip(STEPS, found, strict=True) if imported}
    assert not leaks, f"imported by the step that starts with each module: {leaks}"

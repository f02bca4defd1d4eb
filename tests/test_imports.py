"""What a process pays for at start: the heavy libraries stay out of the jobs that do not use them.

Every command and every test that starts one runs in a fresh interpreter, so an import at the top of a module
costs its CPU in each of them: torchvision imports its detection ops and with them torch._dynamo (more CPU than
torch itself), the handcrafted methods numba, scipy and OpenCV, the report's figures matplotlib.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.paths import REPO

# (what a job runs, the libraries it must not have imported), in one interpreter from the lightest step to the
# heaviest, so each step's list also holds for the steps before it.
STEPS = [
    # the saliency commands and their settings name the handcrafted methods without importing them
    ("import relicv2.cli.saliency, relicv2.saliency.network.config",
     ["relicv2.saliency.handcrafted.methods", "numba", "scipy", "skimage", "torch"]),
    # build-masks, export, the networks' files and the networks themselves, built and run: no torchvision
    ("import relicv2.saliency.network.build_masks, relicv2.evaluation.export, relicv2.models.official\n"
     "import torch\n"
     "from relicv2.saliency.network.model import SaliencyNet\n"
     "with torch.no_grad(): SaliencyNet(depth=18).eval()(torch.zeros(1, 3, 32, 32))",
     ["torchvision", "torch._dynamo", "relicv2.saliency.handcrafted.methods", "numba", "matplotlib", "nvidia.dali"]),
]

PROBE = """
import json, sys
found = []
for code, kept_out in json.loads(sys.argv[1]):
    exec(code, {})
    found.append(sorted(name for name in kept_out if name in sys.modules))
print(json.dumps(found))
"""


def test_each_job_imports_only_the_libraries_it_uses():
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(STEPS)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    leaks = {code.splitlines()[0]: imported for (code, _), imported in zip(STEPS, found, strict=True) if imported}
    assert not leaks, f"imported by the step that starts with each line: {leaks}"

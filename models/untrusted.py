"""Reading torch files a user hands over (pretraining checkpoints, exported encoders, saliency models,
head checkpoints, feature caches): always `torch.load(weights_only=True)`, so nothing in a file runs.

The one owner of what such a load raises for a file that is not one, and of the one-line reason shown
to the user, without torch's advice to retry with `weights_only=False` or to allowlist globals: the
file is not trusted, so running its code is never the way out.
"""

from __future__ import annotations

import pickle
import struct
import zipfile

# A zip torch cannot open, an unpickler meeting bytes that are no pickle (text -> KeyError, a short
# file -> IndexError/EOFError/struct.error), a refused global (UnpicklingError), an unreadable file.
TORCH_LOAD_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError,
                     KeyError, IndexError, struct.error)


def load_failure(error: BaseException) -> str:
    """Why `torch.load(weights_only=True)` could not read a file, in one line, without torch's advice to
    run the file's code (see above)."""
    for line in str(error).strip().splitlines():
        line = line.strip().removeprefix("WeightsUnpickler error:").strip()
        if line and "weights_only" not in line and not line.startswith(
                ("Weights only load failed", "(1)", "(2)", "Please file", "Check the documentation")):
            break
    else:
        line = ""
    # Text or random bytes read as a pickle: a byte that is no opcode, or a stack or memo entry missing.
    if isinstance(error, (KeyError, IndexError, EOFError, struct.error)) or line.startswith("Unsupported operand"):
        return "not a file written by torch.save"
    return line.split(". ")[0].rstrip(".") or type(error).__name__  # the first sentence: the rest is advice

"""Reading a user's torch file: whatever it holds, one short reason and never torch's advice to run its code."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from relicv2.models.untrusted import TORCH_LOAD_ERRORS, load_failure


class _Payload:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize("content", [
    b"hello, not a checkpoint\n", b"", b"\x80\x02", b"PK\x03\x04 a cut zip", pickle.dumps(_Payload(), protocol=2),
], ids=["text", "empty", "cut-pickle", "cut-zip", "code-payload"])
def test_every_unreadable_file_gives_one_short_reason_without_torch_advice(tmp_path, content):
    path = tmp_path / "file.pt"
    path.write_bytes(content)
    with pytest.raises(TORCH_LOAD_ERRORS) as caught:
        torch.load(path, weights_only=True)
    reason = load_failure(caught.value)
    assert reason and "\n" not in reason and "weights_only" not in reason and "trust" not in reason
    assert len(reason) < 200


def test_a_full_checkpoint_cut_short_names_the_damage(tmp_path):
    path = tmp_path / "cut.pt"
    torch.save({"weights": torch.zeros(1000)}, path)
    path.write_bytes(path.read_bytes()[:600])
    with pytest.raises(TORCH_LOAD_ERRORS) as caught:
        torch.load(path, weights_only=True)
    assert "weights_only" not in load_failure(caught.value)

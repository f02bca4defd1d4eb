"""The one torch-file reader and writer: a tagged, versioned, atomically written payload comes back as written;
every file that cannot be used (missing, not a torch file, cut short, a pickle that would run code, another
format, a newer version, a missing or mistyped field) is one TorchFileError, one line naming the file and
what to do, never torch's advice to run the file's code."""

from __future__ import annotations

import errno
import io
import os
import pickle
from pathlib import Path

import pytest
import torch

from relicv2.models import torchfile
from relicv2.models.torchfile import (
    TORCH_LOAD_ERRORS,
    StateDict,
    TorchFileError,
    TorchFormat,
    load_failure,
)

FIX = "pass a file written by the test"
TOY = TorchFormat("toy file", fix=FIX, tag="relicv2-toy", version=2,
                  fields={"step": int, "weights": StateDict, "note": str, "rate": float})
PAYLOAD = {"step": 3, "weights": {"w": torch.arange(4.0)}, "note": "hi", "rate": 0.5}


class _Payload:
    def __reduce__(self):
        return (os.system, ("true",))


class ToyError(TorchFileError):
    pass


def _refusal(path: Path, fmt: TorchFormat = TOY) -> str:
    """The one-line message `fmt` refuses `path` with; it names the file and says what to do."""
    with pytest.raises(TorchFileError) as refused:
        fmt.load(path)
    message = str(refused.value)
    assert message.startswith(str(path)) or message.startswith(f"{fmt.what} {path}")
    assert "\n" not in message and "weights_only" not in message and "trust" not in message
    return message


def _written(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "toy.pt"
    torch.save({"format": "relicv2-toy", "version": 2, **PAYLOAD, **changes}, path)
    return path


def test_a_saved_payload_comes_back_tagged_and_leaves_no_temporary_file(tmp_path):
    path = TOY.save(tmp_path / "sub" / "toy.pt", PAYLOAD)
    payload = TOY.load(path)
    assert payload["format"] == "relicv2-toy" and payload["version"] == 2
    assert payload["step"] == 3 and payload["note"] == "hi" and torch.equal(payload["weights"]["w"], torch.arange(4.0))
    assert os.listdir(tmp_path / "sub") == ["toy.pt"]


def test_a_file_written_before_the_module_existed_still_loads(tmp_path):
    # what the formats wrote with a plain torch.save: the same bytes on disk
    assert TOY.load(_written(tmp_path))["rate"] == 0.5


def test_a_failed_write_keeps_the_earlier_file(tmp_path):
    path = TOY.save(tmp_path / "toy.pt", PAYLOAD)
    with pytest.raises(OSError, match="disk full"), TOY.saving(path, {**PAYLOAD, "step": 4}):
        raise OSError("disk full")  # the companion file (an encoder's sidecar) failed after the payload was written
    assert TOY.load(path)["step"] == 3 and os.listdir(tmp_path) == ["toy.pt"]


class _FullDisk(io.FileIO):
    """A file system that fills after 1,000 bytes: later writes fail with ENOSPC, as the OS's do."""

    def write(self, data) -> int:
        if self.tell() + len(data) > 1000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


def fill_the_disk(monkeypatch) -> None:
    """Every torch file written from now on meets a disk that fills midway."""
    monkeypatch.setattr(torchfile, "_WriteFile", type("FullDisk", (torchfile._WriteFile, _FullDisk), {}))


def test_a_disk_that_fills_midway_is_the_os_error_naming_the_file_not_torch_s_text(tmp_path, monkeypatch):
    path = TOY.save(tmp_path / "toy.pt", PAYLOAD)
    fill_the_disk(monkeypatch)
    with pytest.raises(OSError) as raised:
        TOY.save(path, {**PAYLOAD, "weights": {"w": torch.zeros(10_000)}})
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)
    assert "inline_container" not in str(raised.value)
    assert TOY.load(path)["step"] == 3 and os.listdir(tmp_path) == ["toy.pt"]  # the earlier file, no temporary


def test_a_payload_without_a_required_field_is_not_written(tmp_path):
    with pytest.raises(ValueError, match=r"toy file payload lacks \['note'\]"):
        TOY.save(tmp_path / "toy.pt", {k: v for k, v in PAYLOAD.items() if k != "note"})
    assert os.listdir(tmp_path) == []


def test_a_plain_state_dict_format_writes_no_tag(tmp_path):
    plain = TorchFormat("weights file", fix=FIX, state_dict=True)
    path = plain.save(tmp_path / "w.pt", {"w": torch.ones(2)})
    assert set(torch.load(path, weights_only=True)) == {"w"} and torch.equal(plain.load(path)["w"], torch.ones(2))
    torch.save({"w": [1.0]}, path)
    assert _refusal(path, plain) == f"{path} is not a weights file: it holds a list at 'w', not a tensor; {FIX}"


def test_another_format_is_named(tmp_path):
    path = tmp_path / "toy.pt"
    torch.save({"format": "relicv2-other", "version": 2}, path)
    assert _refusal(path) == f"{path} is not a toy file (its format is 'relicv2-other'); {FIX}"
    torch.save({"conv1.weight": torch.zeros(1)}, path)
    assert _refusal(path) == f"{path} is not a toy file (it holds ['conv1.weight']); {FIX}"
    torch.save([1, 2], path)
    assert _refusal(path) == f"{path} is not a toy file: it is a list, not a dict; {FIX}"


def test_a_newer_version_says_to_upgrade(tmp_path):
    path = _written(tmp_path, version=3)
    assert _refusal(path) == (f"{path} has toy file format version 3, this relicv2 reads version 2; "
                              "upgrade relicv2 to read it")


@pytest.mark.parametrize("version", [1, None, "2", True])
def test_another_version_is_refused(tmp_path, version):
    path = _written(tmp_path, version=version)
    assert _refusal(path) == f"{path} has toy file format version {version!r}, this relicv2 reads version 2; {FIX}"


def test_a_missing_field_is_named(tmp_path):
    path = tmp_path / "toy.pt"
    torch.save({"format": "relicv2-toy", "version": 2, "step": 1, "note": "x", "rate": 1}, path)
    assert _refusal(path) == f"{path} lacks ['weights']: it is an incomplete toy file; {FIX}"


@pytest.mark.parametrize("field, value, says", [
    ("step", "3", "its field 'step' is a str, not an int"),
    ("step", True, "its field 'step' is a bool, not an int"),
    ("rate", None, "its field 'rate' is a NoneType, not a float"),
    ("weights", [torch.zeros(1)], "its field 'weights' is a list, not a dict of tensors"),
    ("weights", {"w": [1.0]}, "its field 'weights' holds a list at 'w', not a tensor"),
], ids=["str for int", "bool for int", "none for a float", "list for a state dict", "list in a state dict"])
def test_a_mistyped_field_is_named(tmp_path, field, value, says):
    path = _written(tmp_path, **{field: value})
    assert _refusal(path) == f"{path} is damaged or hand-made: {says}; {FIX}"


def test_every_failure_raises_the_format_s_own_error(tmp_path):
    toy = TorchFormat("toy file", fix=FIX, tag="relicv2-toy", error=ToyError)
    with pytest.raises(ToyError, match="toy file .*missing.pt does not exist; check the path"):
        toy.load(tmp_path / "missing.pt")
    (tmp_path / "text.pt").write_text("hello\n")
    with pytest.raises(ToyError, match=r"text\.pt is not a readable toy file \(not a file written by torch\.save\)"):
        toy.load(tmp_path / "text.pt")


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
    assert _refusal(path).startswith(f"{path} is not a readable toy file ({reason}); ")


def test_a_full_checkpoint_cut_short_names_the_damage(tmp_path):
    path = tmp_path / "cut.pt"
    torch.save({"weights": torch.zeros(1000)}, path)
    path.write_bytes(path.read_bytes()[:600])
    with pytest.raises(TORCH_LOAD_ERRORS) as caught:
        torch.load(path, weights_only=True)
    assert "weights_only" not in load_failure(caught.value)
    TOY.save(path, PAYLOAD)
    path.write_bytes(path.read_bytes()[:-200])  # a copy killed before its end
    assert _refusal(path).startswith(f"{path} is not a readable toy file (")


def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"format": "relicv2-toy", "version": 2, **PAYLOAD, "note": Evil()}, path)
    message = _refusal(path)
    assert message.startswith(f"{path} is not a readable toy file (") and message.endswith(FIX)
    assert "system" in message  # names what the file asked to run
    assert not marker.exists()

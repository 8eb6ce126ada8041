"""atomic_write: the old file or the new one, never a torn one, and no temp file left."""

import os

import pytest

from lwm.utils.files import atomic_write, temp_path


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "sub" / "x.txt"
    assert atomic_write(path, lambda f: f.write("old"), mode="w") == path  # folders made
    assert path.read_text() == "old"

    def fails(f):
        f.write("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(path, fails, mode="w")
    assert path.read_text() == "old" and os.listdir(path.parent) == ["x.txt"]
    assert temp_path(path).name == f".x.txt.tmp-{os.uname().nodename}-{os.getpid()}"


def test_a_temp_file_is_stale_only_when_its_writer_is_surely_gone(tmp_path, monkeypatch):
    """Of another node (a requeue moved the job): an hour after its last write, not half an hour (a slow write of a
    large checkpoint there). Of this host: when its process is gone; one of another user's live process (kill
    says PermissionError) is alive."""
    import socket

    from lwm.utils.files import stale_temp_files

    other = tmp_path / ".last.ckpt.tmp-other-node-12345"
    other.write_bytes(b"x")
    written = other.stat().st_mtime
    assert stale_temp_files(tmp_path, now=written + 1800) == []
    assert stale_temp_files(tmp_path, now=written + 3601) == [other]
    other.unlink()
    here = tmp_path / f".last.ckpt.tmp-{socket.gethostname()}-4242"
    here.write_bytes(b"x")

    def kill(pid, signal, error):
        raise error

    monkeypatch.setattr(os, "kill", lambda pid, sig: kill(pid, sig, PermissionError()))  # another user's process
    assert stale_temp_files(tmp_path) == []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kill(pid, sig, ProcessLookupError()))  # none of that pid
    assert stale_temp_files(tmp_path) == [here]


def test_the_data_is_synced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """A crash (power, node) soon after a rename could otherwise leave an empty or torn checkpoint under the name."""
    import lwm.training.checkpoint
    import lwm.utils.files

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(lwm.utils.files.os, "fsync", lambda fd: events.append(("fsync", os.path.isdir(
        f"/proc/self/fd/{fd}"))) or real_fsync(fd))
    monkeypatch.setattr(lwm.utils.files.os, "replace", lambda a, b: events.append(("replace", str(b))) or real_replace(a, b))
    path = lwm.training.checkpoint.atomic_save({"global_step": 1}, tmp_path / "last.ckpt")
    assert events == [("fsync", False), ("replace", str(path)), ("fsync", True)]  # file data, rename, folder

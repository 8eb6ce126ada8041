"""atomic_write: the old file or the new one, never a torn one, and no temp file left."""

import os

import pytest

from lwm.files import atomic_write, temp_path


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

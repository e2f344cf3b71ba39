import json
import os

import pytest

from fileio import replacing, replacing_dir, write_json


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = str(tmp_path / "config.json")
    write_json(path, {"a": 1})
    with pytest.raises(RuntimeError):
        with replacing(path) as tmp:
            with open(tmp, "w") as f:
                f.write('{"a": 2, "trunc')
            raise RuntimeError("killed mid-write")
    assert json.load(open(path)) == {"a": 1}
    assert os.listdir(tmp_path) == ["config.json"]


def test_successful_write_replaces(tmp_path):
    path = str(tmp_path / "x.json")
    write_json(path, {"a": 1})
    write_json(path, {"a": 2})
    assert json.load(open(path)) == {"a": 2} and os.listdir(tmp_path) == ["x.json"]


def test_replacing_dir_swaps_in_a_whole_directory(tmp_path):
    out = str(tmp_path / "hf")
    with replacing_dir(out) as tmp:
        open(os.path.join(tmp, "a.txt"), "w").write("one")
    with replacing_dir(out) as tmp:
        assert os.listdir(tmp) == []
        open(os.path.join(tmp, "b.txt"), "w").write("two")
    assert os.listdir(out) == ["b.txt"] and os.listdir(tmp_path) == ["hf"]


def test_replacing_dir_failure_keeps_the_old_directory(tmp_path):
    out = str(tmp_path / "hf")
    with replacing_dir(out) as tmp:
        open(os.path.join(tmp, "a.txt"), "w").write("one")
    with pytest.raises(RuntimeError):
        with replacing_dir(out) as tmp:
            open(os.path.join(tmp, "a.txt"), "w").write("half")
            raise RuntimeError("killed mid-write")
    assert open(os.path.join(out, "a.txt")).read() == "one" and os.listdir(tmp_path) == ["hf"]

import json
import os

import pytest

from fileio import replacing, write_json


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

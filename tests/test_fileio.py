import json
import logging
import os

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.errors import error_handler
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from gpt2train.fileio import launcher_note, replacing, replacing_dir, write_json


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


@pytest.fixture
def umask_027():
    """The process's umask set to 027 for the test (the default 022 would hide a writer's own 0644)."""
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def mode(path):
    return os.stat(path).st_mode & 0o777


def test_files_and_json_follow_the_umask_not_the_temp_files_mode(tmp_path, umask_027):
    path = str(tmp_path / "ckpt.pt")
    with replacing(path) as tmp:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600))  # a private temp, as mkstemp makes them
    assert mode(path) == 0o640
    with replacing(path) as tmp:  # over an existing file, from a writer that made it world-writable
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o666))
        os.chmod(tmp, 0o666)
    assert mode(path) == 0o640
    write_json(str(tmp_path / "config.json"), {"a": 1})
    assert mode(tmp_path / "config.json") == 0o640
    os.umask(0o022)
    write_json(str(tmp_path / "config.json"), {"a": 2})
    assert mode(tmp_path / "config.json") == 0o644


def test_a_directory_follows_the_umask(tmp_path, umask_027):
    out = str(tmp_path / "hf")
    with replacing_dir(out) as tmp:
        assert mode(tmp) == 0o700  # mkdtemp's, while it is built
        os.makedirs(os.path.join(tmp, "sub"), mode=0o700)
        os.close(os.open(os.path.join(tmp, "sub", "w.bin"), os.O_WRONLY | os.O_CREAT, 0o600))
        open(os.path.join(tmp, "config.json"), "w").write("{}")
    assert mode(out) == mode(os.path.join(out, "sub")) == 0o750
    assert mode(os.path.join(out, "sub", "w.bin")) == mode(os.path.join(out, "config.json")) == 0o640


def test_the_error_line_reaches_torchruns_summary_without_warnings_of_its_own(tmp_path, monkeypatch, caplog):
    """torchrun reads a failed worker's error file twice: for its summary (the line, not "To enable traceback
    see ...") and to copy it with the worker's exit code, which logged a warning for a plain-string message."""
    path = str(tmp_path / "error.json")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", path)
    line = "error: --max_steps=ten is not an integer (default: 160)"
    launcher_note(line)
    summary = ChildFailedError("train_gpt2.py", {0: ProcessFailure(0, 1234, 2, path)}).format_msg()
    assert f"traceback : {line}" in summary and "exitcode  : 2" in summary, summary
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    torch_logger = logging.getLogger(error_handler.__name__)  # torch's loggers stop short of caplog's
    torch_logger.addHandler(caplog.handler)
    try:
        ErrorHandler().dump_error_file(path, error_code=2)
    finally:
        torch_logger.removeHandler(caplog.handler)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert not warnings, warnings

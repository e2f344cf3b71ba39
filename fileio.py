"""
Atomic file writes, shared by the scripts: every checkpoint, shard, manifest and JSON report is
written under a temp name beside its target, flushed to disk, then renamed over it. A crash, a full
disk or Ctrl-C leaves the previous file as it was, never a half-written one under the real name.

    from fileio import replacing, write_json
    with replacing("out/ckpt_000100.pt") as tmp:
        torch.save(ckpt, tmp)
    write_json("out/config.json", {"n_layer": 12})
"""
import json
import os
from contextlib import contextmanager


class UserError(Exception):
    """Bad input: printed as one line `error: ...`, exit 2."""


@contextmanager
def replacing(path, suffix=".tmp"):
    """Yields a temp path beside path; when the block succeeds the file is fsynced and renamed to path.
    On an error the temp file is removed and path is untouched. (suffix: e.g. ".tmp.png" for writers
    that pick the format from the name.)"""
    tmp = path + suffix
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path, obj, indent=1):
    with replacing(path) as tmp:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent)

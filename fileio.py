"""
Atomic file writes, shared by the scripts: every checkpoint, shard, manifest and JSON report is
written under a temp name beside its target, flushed to disk, then renamed over it. A crash, a full
disk or Ctrl-C leaves the previous file as it was, never a half-written one under the real name.

    from fileio import replacing, write_json
    with replacing("out/ckpt_000100.pt") as tmp:
        torch.save(ckpt, tmp)
    write_json("out/config.json", {"n_layer": 12})
    with replacing_dir("out/hf") as tmp:          # a whole directory: built aside, then swapped in
        model.save_pretrained(tmp)

UserError is here too, at the bottom of the import graph, so that every module can raise it.
"""
import json
import os
import shutil
import tempfile
from contextlib import contextmanager


class UserError(Exception):
    """Bad input: every script's main() prints `error: <message>` on one line and exits 2."""


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


@contextmanager
def replacing_dir(path):
    """Yields a new empty directory beside path; when the block succeeds its files are fsynced and it
    takes path's place (an existing path is moved aside first and deleted only after the swap). On an
    error the new directory is removed and path is untouched."""
    path = os.path.normpath(path)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=os.path.dirname(path) or ".")
    try:
        yield tmp
        for root, _, names in os.walk(tmp):
            for name in names:
                with open(os.path.join(root, name), "rb+") as f:
                    os.fsync(f.fileno())
        if os.path.exists(path):
            old = tmp + "-old"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)

"""
Atomic file writes, shared by the scripts: every checkpoint, shard, manifest and JSON report is
written under a temp name beside its target, flushed to disk, then renamed over it. A crash, a full
disk or Ctrl-C leaves the previous file as it was, never a half-written one under the real name.
What is written follows the user's umask, whatever the writer made the temp with: files 0666 &
~umask (0644 under umask 022), folders 0777 & ~umask.

    from gpt2train.fileio import replacing, write_json
    with replacing("out/ckpt_000100.pt") as tmp:
        torch.save(ckpt, tmp)
    write_json("out/config.json", {"n_layer": 12})
    with replacing_dir("out/hf") as tmp:          # a whole directory: built aside, then swapped in
        save_hf(model, tmp)                       # (export.py)

UserError is here too, at the bottom of the import graph, so that every module can raise it, with
the one exit-code convention of every script (fail) and the argparse parser that keeps to it:

    try:
        ...
    except (UserError, OSError) as e:
        return fail(e)  # one line on stderr; 2 for bad input, 1 for a failed machine
"""
import argparse
import errno
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager


class UserError(Exception):
    """Bad input: every script's main() prints `error: <message>` on one line and exits 2."""


class DiskFull(OSError):
    """ENOSPC whose message already says how much to free: fail() prints it as it is."""

    def __init__(self, message, filename):
        super().__init__(errno.ENOSPC, message, filename)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a usage error (an unknown option, a value of the wrong type, a missing
    argument) is a UserError like any other bad input: one line and exit 2, not a usage block."""

    def error(self, message):
        raise UserError(f"{message} (python {self.prog} --help lists the options)")


def fail(e, quiet=False):
    """The last word of every script on an error it expects: prints `error: ...` (one line, on
    stderr; nothing when quiet, e.g. on ranks other than 0) and returns the exit code. 2: a
    UserError, bad input or usage (the message names the input and the fix). 1: an OSError while
    working, the machine's failure rather than the input's (a full disk, an I/O error); files are
    written temp-then-rename, so the previous ones are intact and the same command runs again once
    the machine is fixed."""
    if isinstance(e, UserError):
        message, code = str(e), 2
    # a folder the user chose but cannot write: 2
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        what = f"{e.filename}: " if getattr(e, "filename", None) else ""
        message = (f"{what}{e.strerror or e}; choose a folder you can write to, "
                   "or change its permissions")
        code = 2
    elif isinstance(e, DiskFull):
        message, code = f"{e.filename}: {e.strerror}", 1
    else:
        what = f"{e.filename}: " if getattr(e, "filename", None) else ""
        fix = "free some space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "fix that"
        message, code = f"{what}{e.strerror or e}; {fix} and run the same command again", 1
    line = "error: " + " ".join(line.strip() for line in message.splitlines())
    if not quiet:
        print(line, file=sys.stderr)
    launcher_note(line)
    return code


def launcher_note(line):
    """Under torchrun, the error line into this worker's error file as well: torchrun's failure
    summary, printed last, then shows it instead of "To enable traceback see ..." (the line above
    stays visible). In the layout torch's own @record writes, less the traceback: a plain string
    there makes torchrun log a warning of its own about the file (two lines)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": {"message": line,
                                       "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
        except OSError:
            pass


def check_output_file(path, option):
    """UserError unless path can take a file written by an option (--json, --out, ...): not a
    folder, in a folder that exists. Checked before the work, so a long run never ends on a bad
    path."""
    if os.path.isdir(path):
        raise UserError(f"{option} {path} is a folder: name the file to write, e.g. "
                        f"{os.path.join(path, 'out')}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise UserError(f"{option} {path}: its folder does not exist; create it first")


@contextmanager
def naming(path):
    """An OSError raised inside that names no file (a write's ENOSPC, np.save's short write, which
    do not) is raised again naming path, so that the one line fail() prints says which file it
    was."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), path) from e


def umask():
    """The process's umask, read without changing it (/proc; elsewhere set and restored at once)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def chmod(target, mode):
    """os.chmod (of a path or an open file), where the filesystem allows: FUSE mounts may refuse."""
    try:
        os.chmod(target, mode)
    except OSError:
        pass


@contextmanager
def replacing(path, suffix=".tmp"):
    """Yields a temp path beside path; when the block succeeds the file gets mode 0666 & ~umask, is
    fsynced and renamed to path. On an error the temp file is removed and path is untouched.
    (suffix: e.g. ".tmp.png" for writers that pick the format from the name.)"""
    tmp = path + suffix
    try:
        with naming(path):
            yield tmp
            with open(tmp, "rb+") as f:
                # the user's umask, whatever mode the writer made it with
                chmod(f.fileno(), 0o666 & ~umask())
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def missing_dirs(path):
    """The folders of path, itself included, that do not exist yet, deepest first: what
    os.makedirs(path) would make, so that remove_empty_dirs can take them away again."""
    missing, d = [], os.path.abspath(path)
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        missing.append(d)
        d = os.path.dirname(d)
    return missing


def remove_empty_dirs(dirs):
    """Remove the folders missing_dirs listed (deepest first), as long as they are empty: one that
    holds anything stays, and so do those above it."""
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            break


def write_json(path, obj, indent=1):
    with replacing(path) as tmp:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent)


@contextmanager
def replacing_dir(path):
    """Yields a new empty directory beside path; when the block succeeds its files (0666 & ~umask)
    and folders (0777 & ~umask) are given the umask's modes, the files fsynced, and it takes path's
    place (an existing path is moved aside first, deleted after the swap). On an error path is left
    untouched."""
    path = os.path.normpath(path)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-",
                           dir=os.path.dirname(path) or ".")
    try:
        with naming(path):
            yield tmp
            mask = umask()
            for root, _, names in os.walk(tmp):
                # mkdtemp's 0700 and the writers' modes: the user's umask
                chmod(root, 0o777 & ~mask)
                for name in names:
                    with open(os.path.join(root, name), "rb+") as f:
                        chmod(f.fileno(), 0o666 & ~mask)
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

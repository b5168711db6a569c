"""A checkpoint file on disk: atomic save (temp file, fsync, os.replace), load with weights_only=True and CRC checks.

A file that cannot be read (missing, empty, truncated, random bytes, a pickled object that
``weights_only=True`` refuses, a torch file of some other program, a flipped bit) raises
:class:`CheckpointError`, a ``ValueError`` naming the path and what to do. A write that fails (a full
disk, a file-size limit, a read-only folder) raises one too, and leaves the previous file in place.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import re
import socket
import stat
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import _args

__all__ = ["FORMAT", "VERSION", "FILENAME", "CheckpointError", "path_in", "save", "load", "replace_atomically"]


#: Marker and version stored in every file, so a foreign torch file is recognised as such.
FORMAT = "ampcourse.checkpoint"


VERSION = 1


#: The file name train() uses inside its checkpoint directory.
FILENAME = "checkpoint.pt"


_REQUIRED = ("format", "version", "step", "model", "optimizer", "scaler", "scheduler", "rng")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written; the message names the file and what to do about it."""


def path_in(directory: str | os.PathLike) -> Path:
    """The checkpoint file inside a run directory."""
    return _as_path(directory, "directory") / FILENAME


def _as_path(value: Any, name: str) -> Path:
    """value as a Path (a str or os.PathLike, no NUL byte); ValueError naming it otherwise (pathlib's names nothing)."""
    return _args.as_path(value, name)


def _plain(obj: Any) -> Any:
    """obj with numpy scalars (and 0-d arrays) turned into Python numbers, through dicts, lists and tuples.

    torch.load(weights_only=True) refuses numpy objects, so a run started with lr=np.float64(1e-3) (which an
    optimizer stores in its param_groups as given) would write a checkpoint it can never read back.
    """
    if isinstance(obj, (np.generic, np.ndarray)) and np.ndim(obj) == 0:
        return obj.item()
    if isinstance(obj, dict):
        return {_plain(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):  # namedtuples stay as they are
        return type(obj)(_plain(v) for v in obj)
    return obj


_SAFE_LEAVES = (torch.Tensor, bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _check_loadable(obj: Any, where: str, path: Path) -> None:
    """CheckpointError naming the entry unless torch.load(weights_only=True) can read `obj` back.

    Checked before writing: a checkpoint that saves but cannot be loaded would replace a good one on disk and
    be found out only at resume. Leaves of a known-safe type pass at once; any other is round-tripped alone
    through weights_only=True, so the answer is torch's own.
    """
    if isinstance(obj, _SAFE_LEAVES):
        return
    if type(obj) in (dict, list, tuple) or isinstance(obj, collections.OrderedDict):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            if isinstance(obj, dict):
                _check_loadable(key, f"{where} key {key!r}", path)
            _check_loadable(value, f"{where}[{key!r}]", path)
        return
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception:
        raise CheckpointError(f"cannot save a checkpoint to {str(path)!r}: {where} is a {type(obj).__name__}, which "
                              "torch.load(weights_only=True) cannot read back; keep only tensors, numbers, strings, "
                              "lists, tuples and dicts in it. Nothing was written") from None


def _temp_prefix(path: Path) -> str:
    """Temp files name their writer (host and pid), so a later save can tell a dead writer's leftovers."""
    return f".{path.name}.{socket.gethostname()}.{os.getpid()}."


def _writer_is_dead(host: str, pid: int) -> bool:
    """True only when the writer ran on this host and that process no longer exists (POSIX; never on Windows)."""
    if os.name != "posix" or host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # e.g. it exists but belongs to another user
        return False
    return False


def _remove_stale_temps(path: Path) -> list[Path]:
    """Delete temp files that writers of this checkpoint left when they were killed mid-write; return them.

    Such a file was never renamed into place, so no run resumes from it; the checkpoint just saved
    is newer. Files of live writers, of other hosts (a shared filesystem) and of other names stay.
    """
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(?P<host>.+)\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp$")
    removed = []
    for candidate in path.parent.iterdir():
        m = pattern.match(candidate.name)
        if m and _writer_is_dead(m["host"], int(m["pid"])):
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
    return removed


def rename_target(path: Path) -> Path:
    """The path a temp file may be renamed onto: `path`, or the file a symbolic link names (the link stays a link).

    A rename replaces whatever has the name: run as root, ``os.replace(tmp, "/dev/null")`` turns the device into a
    regular file for every program on the machine, and over a FIFO or a socket it cuts off whoever listens. So a
    name that is not a regular file (after following links) is refused, with a CheckpointError naming it.
    """
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target  # a new file (or a link to one not written yet): nothing is replaced
    except OSError as err:
        raise CheckpointError(f"cannot write {str(path)!r}: {err.strerror or err}") from None
    if stat.S_ISDIR(mode):
        raise CheckpointError(f"cannot save a checkpoint to {str(path)!r}: it is a directory; give a file path "
                              f"such as {str(path / FILENAME)!r}")
    if not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
                "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")
        raise CheckpointError(f"cannot write {str(path)!r}: it is {kind}, not a regular file; a checkpoint is written "
                              "to a temporary file and renamed over the name, which would replace it. Give the path "
                              "of a regular file (or of one that does not exist yet)")
    return target


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc/self/status, Linux >= 4.7)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere the only way to read it is to set it (and put it back at once)
    os.umask(mask)
    return mask


def _open_mode(target: Path) -> int:
    """The permission bits a plain open(target, "wb") would leave: an existing file keeps its own, a new one gets
    0o666 & ~umask. mkstemp makes its temp file 0o600 and os.replace keeps that, so without this every checkpoint
    would be readable by its owner only, whatever the umask: a group sharing --checkpoint-dir could not resume it."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def replace_atomically(path: str | os.PathLike, data: bytes) -> Path:
    """Write bytes to `path` atomically (temp file in the same folder, fsync, os.replace); refuses non-regular files.

    Example::

        >>> replace_atomically(Path("runs/a/sharded/latest"), b"step-00000008\n")
    """
    target = rename_target(_as_path(path, "path"))
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), _open_mode(target))  # not mkstemp's 0o600 (see _open_mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)
    return target


def _check_writable_folder(path: Path) -> None:
    """CheckpointError naming the path unless its folder exists and is a directory (before any bytes are written)."""
    folder = path.parent
    if path.is_dir():
        raise CheckpointError(f"cannot save a checkpoint to {str(path)!r}: it is a directory; give a file path "
                              f"such as {str(path / FILENAME)!r}")
    if not folder.exists():
        raise CheckpointError(f"cannot save a checkpoint to {str(path)!r}: the folder {str(folder)!r} does not exist; "
                              "create it first (train() creates its checkpoint_dir itself)")
    if not folder.is_dir():
        raise CheckpointError(f"cannot save a checkpoint to {str(path)!r}: {str(folder)!r} is not a directory")


class _WriteRecorder:
    """The temp file as torch.save sees it: it keeps the first OSError a write raised.

    torch's zip writer turns a failed write (ENOSPC, EFBIG, EIO) into its own RuntimeError ("[enforce fail at
    inline_container.cc:...] unexpected pos ..."), which names neither the cause nor the file; the cause
    recorded here lets save() say "no space left on device" and where.
    """

    def __init__(self, fh) -> None:
        self._fh = fh
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._fh.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        try:
            self._fh.flush()
        except OSError as err:
            self.error = self.error or err
            raise

    def __getattr__(self, name: str):  # fileno, tell, ...: the file's own
        return getattr(self._fh, name)


@contextlib.contextmanager
def _crc32_on():
    """torch.save with CRC-32s, whatever torch.serialization.set_crc32_options said: load() checks them.

    With the option off torch stores CRC 0 for every member, and load() would refuse the file as damaged.
    """
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    before = get() if get is not None else True
    if not before:
        set_(True)
    try:
        yield
    finally:
        if not before:
            set_(False)


def _write_failed(path: Path, err: OSError) -> CheckpointError:
    """The error for a write that the disk refused: what happened (ENOSPC, EFBIG, ...), where, and what stays."""
    what = err.strerror or str(err)
    return CheckpointError(f"cannot save a checkpoint to {str(path)!r}: {what[:1].lower() + what[1:]} "
                           f"(errno {err.errno}) while writing in {str(path.parent)!r}; the previous checkpoint there, "
                           "if any, is intact. Free some space (or raise the file-size limit), or choose another "
                           "checkpoint_dir")


def save(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write atomically: a temp file in the same directory, fsync, then os.replace over the old file.

    A writer killed mid-write (SIGKILL, power loss) leaves the previous checkpoint intact and a temp file
    named after its host and pid; the next successful save here deletes such leftovers of dead writers.
    A write the disk refuses (full: ENOSPC; too large: EFBIG) is a CheckpointError saying so and where; the
    temp file is removed and the previous checkpoint stays. CRC-32s are written whatever torch's global
    setting (``load`` checks them).
    """
    path = _as_path(path, "path")
    _check_writable_folder(path)
    path = rename_target(path)  # a link's target (the link stays); a device, pipe or socket is refused
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"cannot save {_args.shown(state)} to {str(path)!r}: save() writes a checkpoint made by "
                              "checkpoint.capture(...) (a dict with format 'ampcourse.checkpoint'), which load() reads")
    state = _plain(state)  # numpy scalars would be unreadable with weights_only=True
    _check_loadable(state, "state", path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise CheckpointError(f"cannot save a checkpoint to {str(path)!r}: cannot create a file in "
                              f"{str(path.parent)!r} ({err.strerror}); choose a folder you can write to") from err
    try:
        with os.fdopen(fd, "wb") as fh:
            recorder = _WriteRecorder(fh)
            try:
                os.fchmod(fh.fileno(), _open_mode(path))  # not mkstemp's 0o600 (see _open_mode)
                with _crc32_on():
                    torch.save(state, recorder)
                fh.flush()
                os.fsync(fh.fileno())  # the bytes are on disk before the name points at them
            except OSError as err:
                raise _write_failed(path, err) from err
            except RuntimeError as err:
                if recorder.error is None:
                    raise
                raise _write_failed(path, recorder.error) from err  # torch's message hides the OSError
        os.replace(tmp, path)  # atomic on POSIX and Windows: readers see the old file or the new one
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)  # only our own temp file; the previous checkpoint stays
        if isinstance(err, OSError):  # closing the file (its last flush) or the rename
            raise _write_failed(path, err) from err
        raise
    _fsync_dir(path.parent)
    _remove_stale_temps(path)
    return path


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unreadable(path: Path, why: str) -> CheckpointError:
    """The error for a file that is not a usable checkpoint, with what to do."""
    return CheckpointError(
        f"cannot resume from {str(path)!r}: {why}. It was left untouched; move it aside or point "
        "checkpoint_dir / --checkpoint-dir at another directory, or start without resume to train from step 0 "
        "in a fresh directory.")


def _verify_crcs(path: Path) -> bool:
    """For a zip file (torch's format): CheckpointError unless every member matches its CRC-32; True once checked.

    torch.load itself does not check them, so without this a flipped bit in a tensor loads silently.
    Not a zip at all: False, and torch.load's own error (or load()'s refusal of a legacy file) follows.
    """
    try:
        is_zip = zipfile.is_zipfile(path)
    except zipfile.BadZipFile as err:  # a damaged end record ("zipfiles that span multiple disks"): is_zipfile lets it out
        raise _unreadable(path, f"it is truncated or not a torch file (BadZipFile: {err})") from err
    if not is_zip:
        return False
    try:
        with zipfile.ZipFile(path) as zf:
            damaged = zf.testzip()  # reads every member and compares its CRC-32
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError) as err:
        raise _unreadable(path, f"it is truncated or not a torch file ({type(err).__name__}: {err})") from err
    except OSError as err:  # a read error, or a damaged header that made a member unreadable
        raise _unreadable(path, f"it cannot be read ({err.strerror or err})") from err
    if damaged is not None:
        raise _unreadable(path, f"its data are damaged: {damaged!r} fails its CRC-32 check (a flipped bit, "
                                "a failing disk or an incomplete copy); the bytes differ from what was saved")
    return True


def _check_map_location(where: Any) -> None:
    """ValueError naming map_location unless torch.load can put tensors there (a device here, a dict or a callable).

    torch.load's own error for map_location="cuda" on a machine without CUDA would surface inside load()'s
    catch-all as "truncated or not a torch file": a good checkpoint blamed for a wrong argument.
    """
    if where is None or callable(where) or isinstance(where, dict):
        return
    if isinstance(where, bool) or not isinstance(where, (str, torch.device)):
        raise ValueError(f"map_location must be a device such as 'cpu' or 'cuda:0' (str or torch.device), "
                         f"got {_args.shown(where)}")
    try:
        device = torch.device(where)
    except (RuntimeError, ValueError):
        raise ValueError(f"map_location {where!r} is not a device; use 'cpu', 'cuda', 'cuda:N' or 'mps'") from None
    if device.type == "cuda" and (not torch.cuda.is_available()
                                  or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"map_location {where!r}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                         "load to 'cpu' (the default) and move the tensors after")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"map_location {where!r}: MPS is not available here; load to 'cpu' (the default)")


def load(path: str | os.PathLike, map_location: str | torch.device = "cpu",
         required: tuple[str, ...] = _REQUIRED) -> dict[str, Any]:
    """Read a checkpoint with torch.load(weights_only=True) and check it is ours; CheckpointError if not."""
    path = _as_path(path, "path")
    _check_map_location(map_location)  # before: a bad device was reported as a damaged file
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {str(path)!r}; train without resume first, or check the path")
    if path.is_dir() and path.name != FILENAME:  # the run directory instead of its file: say which file, as save() does
        raise CheckpointError(f"cannot load a checkpoint from {str(path)!r}: it is a directory; give a file path "
                              f"such as {str(path_in(path))!r}")
    if not path.is_file():
        raise _unreadable(path, "it is not a regular file")
    if path.stat().st_size == 0:
        raise _unreadable(path, "the file is empty (a write that never finished?)")
    checked = _verify_crcs(path)
    try:
        with warnings.catch_warnings():  # a garbage file can make the unpickler warn before it fails
            warnings.simplefilter("ignore", UserWarning)
            # mmap=False: the global torch.serialization.config.load.mmap must not change how a checkpoint loads
            state = torch.load(path, map_location=map_location, weights_only=True, mmap=False)
    except pickle.UnpicklingError as err:
        if "global" in str(err).lower():  # a pickled object of some class or function: never unpickle it
            raise _unreadable(path, "torch.load(weights_only=True) refused it: it holds Python objects other than "
                                    "tensors and plain containers, which could run code when unpickled") from err
        raise _unreadable(path, "it is truncated or not a torch file (the unpickler met bytes it cannot read)") from err
    except Exception as err:  # torch.load on random bytes raises RuntimeError, IndexError, KeyError, ...
        raise _unreadable(path, f"it is truncated or not a torch file ({type(err).__name__})") from err
    if not checked:  # torch's legacy (non-zip) format: no checksums, and never written by save()
        raise _unreadable(path, "it is a torch file in the legacy non-zip format, which carries no checksums "
                                "(checkpoint.save writes zip files only)")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise _unreadable(path, f"it is a torch file but not an {FORMAT} file")
    if state.get("version") != VERSION:
        raise _unreadable(path, f"it has format version {state.get('version')!r}; this ampcourse reads {VERSION}")
    missing = [k for k in required if k not in state]
    if missing:
        raise _unreadable(path, f"it lacks {', '.join(missing)}")
    return state

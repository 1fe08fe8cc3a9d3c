"""Atomic, self-describing file output: every artefact is written to a temp file (or folder) and renamed into place,
so an interrupted command never leaves a half file that looks whole. Standard library only (safetensors is imported
by the two tensor helpers when they are called)."""

from __future__ import annotations

import atexit
import fcntl
import glob
import hashlib
import json
import os
import shutil
import socket
import stat
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once: os.umask is process-wide and setting it is not thread-safe
FILE_MODE = 0o666 & ~_UMASK  # what an ordinary file of this user gets
DIR_MODE = 0o777 & ~_UMASK


# Temp names carry their writer (host and pid): ``.<name>.<host>-<pid>.<random>.tmp``. A writer killed with SIGKILL
# (or by the OOM killer) cannot remove its temp; the next writer of the same path on this host removes it once that
# process is gone, so an interrupted export does not leave gigabytes behind. Temps of other hosts (a shared file
# system) are never touched.
_HOST = socket.gethostname().replace(".", "_") or "host"


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.{_HOST}-{os.getpid()}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Remove the temp files and folders beside ``path`` left by writers of this host that no longer run; returns
    what was removed."""
    path = Path(path)
    removed = []
    for p in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        host, _, pid = p.name[len(path.name) + 2 :].split(".", 1)[0].rpartition("-")
        if host != _HOST or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


class NotAFileError(OSError):
    """The target of a write exists and is not a regular file (a device, a FIFO, a socket, a symbolic link): a rename
    would replace it, so nothing is written."""


def check_replaceable(path: str | os.PathLike) -> None:
    """Raise ``NotAFileError`` when ``path`` exists and is anything but a regular file. A rename onto ``/dev/full``,
    a FIFO or a symbolic link replaces the device node, the pipe or the link itself (run as root, the device became
    a regular file)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there (whether it can be created is checked elsewhere)
        return
    if not stat.S_ISREG(mode):
        kind = ("a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else
                "a named pipe" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise NotAFileError(f"{path}: is {kind}; only a regular file is ever replaced")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success rename it onto ``path``, on error delete it. Only a regular file
    (or nothing) is ever replaced: the check runs before and again just before the rename."""
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, FILE_MODE)  # mkstemp makes 0600; the result should be an ordinary file
    try:
        yield tmp_path
        os.chmod(tmp_path, FILE_MODE)  # a writer may have replaced the file (safetensors creates its own, 0600)
        check_replaceable(path)  # something may have appeared there while we wrote
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()
        release(path)


class OutputBusyError(OSError):
    """Another live process is writing the same output: two writers to one path would both succeed and one output
    would vanish (the second rename replaces the first), so the later one is refused before it does any work."""


# One writer per output. A claim is an exclusive advisory lock (flock) on a hidden ``.<name>.lock`` beside the output,
# taken before any work (``outputs.check_*``) and held until the output is renamed into place or discarded
# (``atomic_dir``/``atomic_path`` release it), the command ends (``release_claims``) or the process exits; the kernel
# drops it when a writer dies, even by SIGKILL, so a crashed writer never blocks the next one. Claims are re-entrant
# within a process (a command checks its output twice). Local file systems only, like flock itself.
_CLAIMS: dict[Path, int] = {}


def _lock_path(path: Path) -> Path:
    name = path.name if len(path.name.encode()) <= 200 else hashlib.sha256(path.name.encode()).hexdigest()[:32]
    return path.parent / f".{name}.lock"  # a long name is hashed: the lock's must fit where the output's does


def claim(path: str | os.PathLike) -> None:
    """Claim ``path`` for writing by this process, or raise ``OutputBusyError`` naming the live writer. Creates the
    missing parent folders (the lock file lives beside the output)."""
    path = Path(os.path.abspath(path))
    if path in _CLAIMS:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = _lock_path(path)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise OutputBusyError(f"{path}: another bdlora command ({holder}) is writing it now; wait for it to "
                                  "finish or choose another output") from None
        # the holder before us may have removed the lock file after we opened it: then our lock is on a dead inode
        # and a third writer could lock a new file at the same name; take the lock again on what is there now
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    _CLAIMS[path] = fd


def release(path: str | os.PathLike) -> None:
    """Drop this process's claim on ``path`` (if any) and remove its lock file: the output is in place, or gone."""
    path = Path(os.path.abspath(path))
    fd = _CLAIMS.pop(path, None)
    if fd is None:
        return
    try:
        os.unlink(_lock_path(path))  # while still locked: a waiter that opened it re-checks the inode
    except OSError:
        pass
    os.close(fd)


def release_claims() -> None:
    """Drop every claim this process holds (called when a command ends, and at exit)."""
    for path in list(_CLAIMS):
        release(path)


atexit.register(release_claims)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def save_tensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """safetensors, atomically; tensors are made contiguous and detached (shared storage is not allowed)."""
    from safetensors.torch import save_file

    clean = {k: v.detach().contiguous().clone() if _shares(v, tensors) else v.detach().contiguous()
             for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(clean, str(tmp), metadata=metadata)


# safetensors' names of the dtypes a model folder holds
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def stream_tensors(path: str | os.PathLike, shapes: dict, value, metadata: dict[str, str] | None = None) -> None:
    """A safetensors file (atomically) written one tensor at a time: ``shapes`` (name -> tensor, on the meta device
    or real: its shape and dtype, in the file's order) gives the header; each tensor's bytes come from
    ``value(name, tensor)`` when its turn comes (a real tensor is its own value), so a model whose weights are never
    whole in memory (``compress --one-shot`` of a 1B-8B source) is written with one tensor held. The format
    safetensors documents: the header's length (8 bytes, little-endian), its JSON (padded with spaces to 8 bytes),
    the tensors' bytes back to back."""
    import torch

    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    end = 0
    for name, t in shapes.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                        "data_offsets": [end, end + size]}
        end += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, t in shapes.items():
            v = (value(name, t) if t.is_meta else t).detach().to("cpu", t.dtype).contiguous()
            if tuple(v.shape) != tuple(t.shape):
                raise ValueError(f"{name}: its value is {list(v.shape)}, the header says {list(t.shape)}")
            f.write(v.reshape(-1).view(torch.uint8).numpy().data)
            del v


def load_tensors(path: str | os.PathLike, device: str = "cpu") -> dict:
    from safetensors.torch import load_file

    return load_file(str(path), device=device)


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory under a temp name and rename it into place when complete. Every file in it gets ordinary
    permissions (libraries such as safetensors or transformers may create theirs 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent))
    os.chmod(tmp, DIR_MODE)  # mkdtemp makes 0700; the result should be an ordinary directory
    try:
        yield tmp
        for f in tmp.rglob("*"):
            os.chmod(f, DIR_MODE if f.is_dir() else FILE_MODE)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        release(path)


def _shares(t, all_tensors: dict) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return sum(1 for v in all_tensors.values() if v.untyped_storage().data_ptr() == ptr) > 1


def _json_default(o: Any):
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "tolist"):  # numpy arrays and torch tensors
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def sha256(path: Path, chunk: int = 1 << 20) -> str:
    """The hex SHA-256 of the file at ``path``, read ``chunk`` bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()

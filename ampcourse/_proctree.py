"""Processes from /proc, stdlib only: a process's stat fields, its descendants, whether it still runs.

One home for the walk that stops torchrun's workers (ampcourse.distributed.launch) and a cut GPU check's step
(tools/gpu_test.py). It imports nothing but the standard library, so tools/gpu_test.py, whose parent process must
run on a Python that may not have torch or ampcourse, loads this file by its path (no package import).

    >>> from ampcourse._proctree import descendants, alive
    >>> alive(os.getpid()), descendants(1)[:3]
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["stat", "descendants", "alive"]


def stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...); [] if gone.

    Args:
        pid: a process id.

    Example:
        >>> stat(os.getpid())[0]  # the state: 'R' running, 'S' sleeping, 'Z' zombie
        'R'
    """
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def descendants(pid: int) -> list[int]:
    """PIDs of every descendant of `pid`, from /proc (Linux); empty where /proc does not exist.

    torchrun starts each worker in a session of its own, so killing a process group alone would leave them (and
    the memory they hold) behind; a walk of the parent links finds them.

    Args:
        pid: the ancestor.

    Example:
        >>> descendants(os.getpid())  # a process that started none
        []
    """
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(entry.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
        children.setdefault(ppid, []).append(int(entry.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether pid is a running process (a zombie, dead and waiting for its parent to reap it, is not).

    Args:
        pid: a process id.

    Example:
        >>> alive(os.getpid())
        True
    """
    fields = stat(pid)
    return bool(fields) and fields[0] != "Z"

"""Writes that survive a crash or a power loss: fsync of files and directories, and a directory
replaced by a complete new one.

A rename is only durable once the directory holding the name is fsynced, and a file's contents only
once the file is: the helpers here do both, files before the directories that name them.
"""
from __future__ import annotations

import os
import shutil


def fsync_path(path: str) -> None:
    """fsync a file or directory (a directory's fsync makes the names created in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and directory under `root` (what this process can see), files first."""
    for here, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(here, name))
        fsync_path(here)


def staging_dir(target: str, kind: str = "tmp") -> str:
    """`<parent>/.<name>.<kind>-<pid>`: a sibling of `target` on the same filesystem (so a rename
    moves it into place) that no other process writing the same target uses. A symbolic link is
    followed: the directory it names is the one replaced, and the link stays."""
    target = os.path.realpath(target)
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{kind}-{os.getpid()}")


def replace_dir(new: str, target: str) -> None:
    """Put the complete directory `new` at `target`; the previous `target` stays whole until then.

    `new` is fsynced first; an existing `target` is renamed aside, `new` renamed in, the parent
    fsynced, and only then is the old one removed. A crash leaves the previous directory at `target`
    or, between the two renames, at `.<name>.old-<pid>` beside it with the new one complete next to it.
    """
    target = os.path.realpath(target)
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"{target}: not a directory; refusing to replace it with {new}")
    fsync_tree(new)
    parent = os.path.dirname(target)
    old = None
    if os.path.exists(target):
        old = staging_dir(target, "old")
        if os.path.lexists(old):  # a leftover of a killed process that had this pid
            shutil.rmtree(old)
        os.rename(target, old)
    os.rename(new, target)
    fsync_path(parent)
    if old is not None:
        shutil.rmtree(old)

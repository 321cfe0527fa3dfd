"""``LocalStore``: a directory as an object store.

Create-only writes go to a temp file that is then hard-linked to its final name, so a reader
never sees a partial object and a SIGKILL at any point leaves either no object or a complete
one. Compare-and-swap takes an ``flock`` on the object's directory (released by the kernel
when a process dies) and keeps generations in a per directory state file; a CAS interrupted
between its rename and its state update is detected from the object's inode fingerprint and
given a fresh generation, never an old one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from pipeline.storage.base import (
    _COPY_CHUNK,
    _TMP_PREFIX,
    RESERVED_PREFIX,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    _join,
    _unlink_quiet,
    _validate_prefix,
    _write_replacing,
    validate_key,
)
from pipeline.storage.urls import StorageUrl

log = logging.getLogger(__name__)

_STATE_NAME = RESERVED_PREFIX + "generations.json"


class LocalStore(ObjectStore):
    """A directory as an object store (see the module docstring for the crash-safety design).

    ``fsync=True`` also survives power loss (data and directory entries are fsynced); without
    it every operation is still atomic with respect to process crashes (SIGKILL).
    Requires a local POSIX filesystem with hard links and ``flock`` (not NFS).
    A local store cannot hold both ``a`` and ``a/b`` (a file cannot be a directory).
    """

    URL_FORMS = "a local path (/abs/dir or relative/dir), file:///abs/dir"

    @classmethod
    def from_url(cls, url: StorageUrl, **options: Any) -> LocalStore:
        return cls(url.key, **options)

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self._root = os.path.abspath(os.fspath(root))
        self._fsync = fsync

    @property
    def root(self) -> str:
        return self._root

    @property
    def url(self) -> str:
        return "file://" + self._root

    def path_of(self, key: str) -> str:
        """The file holding ``key`` (for tests and tools that need the raw bytes)."""
        return os.path.join(self._root, *validate_key(key).split("/"))

    def child(self, prefix: str) -> LocalStore:
        return LocalStore(self.path_of(prefix.strip("/")), fsync=self._fsync)

    # -- create-only

    def write_new(self, key: str, data: bytes) -> bool:
        view = memoryview(data)
        return self._create(key, lambda f: f.write(view))

    def write_new_file(self, key: str, local_path: str | os.PathLike[str]) -> bool:
        with open(local_path, "rb") as src:
            return self._create(key, lambda f: shutil.copyfileobj(src, f, _COPY_CHUNK))

    def _create(self, key: str, fill: Callable[[BinaryIO], Any]) -> bool:
        path = self.path_of(key)
        parent = os.path.dirname(path)
        self._makedirs(parent, key)
        tmp = self._write_temp(parent, fill, key)
        try:
            try:
                # link() fails if the name exists: the create-only commit point. The object
                # appears complete or not at all.
                os.link(tmp, path)
            except FileExistsError:
                if os.path.isdir(path):
                    raise StorageError(
                        f"cannot create {self.url_of(key)}: a local store holds keys under "
                        f"{key}/ so {key} cannot also be an object"
                    ) from None
                return False
            except OSError as exc:
                raise StorageError(
                    f"write_new {self.url_of(key)} failed: {exc} (the local store needs a "
                    "filesystem with hard links)"
                ) from exc
            self._sync_dir(parent)
            return True
        finally:
            _unlink_quiet(tmp)

    # -- reads

    def read(self, key: str) -> bytes:
        try:
            with open(self.path_of(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(self.url_of(key)) from None

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise ValueError(f"read_range needs start >= 0 and length >= 0, got {start}, {length}")
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(self.url_of(key)) from None
        try:
            return os.pread(fd, length, start)
        finally:
            os.close(fd)

    def read_to_file(self, key: str, local_path: str | os.PathLike[str]) -> None:
        try:
            src = open(self.path_of(key), "rb")  # noqa: SIM115 - closed below
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(self.url_of(key)) from None
        with src:
            _write_replacing(local_path, lambda out: shutil.copyfileobj(src, out, _COPY_CHUNK))

    def exists(self, key: str) -> bool:
        return os.path.isfile(self.path_of(key))

    def list(self, prefix: str = "") -> list[str]:
        prefix = _validate_prefix(prefix)
        base_rel = prefix.rpartition("/")[0]
        base = os.path.join(self._root, *base_rel.split("/")) if base_rel else self._root
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            rel = os.path.relpath(dirpath, self._root)
            rel = "" if rel == "." else rel.replace(os.sep, "/")
            # Descend only into directories that can still hold keys matching the prefix.
            dirnames[:] = [
                d
                for d in dirnames
                if not d.startswith(RESERVED_PREFIX)
                and (
                    _join(rel, d + "/").startswith(prefix) or prefix.startswith(_join(rel, d + "/"))
                )
            ]
            for name in filenames:
                if name.startswith(RESERVED_PREFIX):
                    continue
                key = _join(rel, name)
                if key.startswith(prefix):
                    keys.append(key)
        keys.sort()
        return keys

    # -- generations and CAS

    def delete(self, key: str) -> None:
        path = self.path_of(key)
        parent, name = os.path.split(path)
        if not os.path.isdir(parent):
            return
        with self._dir_lock(parent):
            # Forget the generation before unlinking: a crash in between leaves an object with
            # no recorded generation, which simply gets a fresh one (never a reused one).
            state = self._load_state(parent)
            if name in state["objects"]:
                del state["objects"][name]
                self._save_state(parent, state)
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(path)
            self._sync_dir(parent)

    def read_versioned(self, key: str) -> tuple[bytes, int] | None:
        path = self.path_of(key)
        parent, name = os.path.split(path)
        if not os.path.isdir(parent):
            return None
        with self._dir_lock(parent):
            state = self._load_state(parent)
            try:
                f = open(path, "rb")  # noqa: SIM115 - closed below
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                if state["objects"].pop(name, None) is not None:
                    self._save_state(parent, state)
                return None
            with f:
                st = os.fstat(f.fileno())
                data = f.read()
            generation, changed = _observe(state, name, st)
            if changed:
                self._save_state(parent, state)
            return data, generation

    def compare_and_swap(self, key: str, data: bytes, expected_generation: int | None) -> bool:
        path = self.path_of(key)
        parent, name = os.path.split(path)
        self._makedirs(parent, key)
        with self._dir_lock(parent):
            state = self._load_state(parent)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            if st is not None and not _is_regular(st):
                raise StorageError(
                    f"cannot CAS {self.url_of(key)}: keys exist under {key}/ in a local store"
                )
            current, changed = _observe(state, name, st) if st is not None else (None, False)
            if current != expected_generation:
                if changed:
                    self._save_state(parent, state)
                return False
            view = memoryview(data)
            tmp = self._write_temp(parent, lambda f: f.write(view), key)
            try:
                fingerprint = os.stat(tmp)
                if expected_generation is None:
                    try:
                        os.link(tmp, path)  # a lock-free write_new may have won meanwhile
                    except FileExistsError:
                        return False
                else:
                    # Atomic replace. If we die before the state is saved, the new inode
                    # will not match the recorded fingerprint and gets a fresh generation.
                    os.replace(tmp, path)
            finally:
                _unlink_quiet(tmp)
            state["objects"][name] = [_next_generation(state), *_fingerprint(fingerprint)]
            self._save_state(parent, state)
            self._sync_dir(parent)
            return True

    # -- housekeeping

    def remove_stale_temp_files(self, older_than_s: float = 3600.0) -> int:
        """Delete temp files left by killed writers; returns how many were removed."""
        cutoff = time.time() - older_than_s
        removed = 0
        for dirpath, _dirs, filenames in os.walk(self._root):
            for name in filenames:
                if name.startswith(_TMP_PREFIX):
                    p = os.path.join(dirpath, name)
                    with contextlib.suppress(FileNotFoundError):
                        if os.stat(p).st_mtime < cutoff:
                            os.unlink(p)
                            removed += 1
        return removed

    # -- internals

    def _makedirs(self, parent: str, key: str) -> None:
        try:
            os.makedirs(parent, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise StorageError(
                f"cannot create {self.url_of(key)}: a parent of it is an object in this local "
                f"store ({exc})"
            ) from exc

    def _write_temp(self, parent: str, fill: Callable[[BinaryIO], Any], key: str) -> str:
        tmp = os.path.join(parent, f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "xb") as f:
                fill(f)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException as exc:
            _unlink_quiet(tmp)
            if isinstance(exc, OSError):
                raise StorageError(f"writing {self.url_of(key)} failed: {exc}") from exc
            raise
        return tmp

    def _sync_dir(self, parent: str) -> None:
        if self._fsync:
            fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def _dir_lock(self, parent: str) -> Iterator[None]:
        # flock on the directory itself: no lock files to clean up, every open() is its own
        # lock owner (so threads exclude each other too), released by the kernel on death.
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _load_state(self, parent: str) -> dict[str, Any]:
        try:
            with open(os.path.join(parent, _STATE_NAME), "rb") as f:
                state = json.loads(f.read())
            if isinstance(state.get("counter"), int) and isinstance(state.get("objects"), dict):
                return state
        except FileNotFoundError:
            pass
        except ValueError:
            # Unreadable state: forgetting generations is safe, every object gets a fresh one.
            log.warning("discarding unreadable generation state in %s", parent)
        return {"counter": 0, "objects": {}}

    def _save_state(self, parent: str, state: dict[str, Any]) -> None:
        tmp = self._write_temp(parent, lambda f: f.write(json.dumps(state).encode()), _STATE_NAME)
        try:
            os.replace(tmp, os.path.join(parent, _STATE_NAME))
        finally:
            _unlink_quiet(tmp)


def _is_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode)


def _fingerprint(st: os.stat_result) -> list[int]:
    # A CAS renames a temp file created while the old object was still linked, so the new
    # object's inode number always differs from the recorded one.
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _next_generation(state: dict[str, Any]) -> int:
    # Monotonic per directory and seeded from the clock (microseconds, like GCS), so a
    # generation is never reused even if the state file or the directory is recreated.
    generation = max(state["counter"] + 1, time.time_ns() // 1000)
    state["counter"] = generation
    return generation


def _observe(state: dict[str, Any], name: str, st: os.stat_result) -> tuple[int, bool]:
    """Generation of the object with stat ``st``; assigns a fresh one if it is not recorded."""
    entry = state["objects"].get(name)
    fingerprint = _fingerprint(st)
    if entry is not None and entry[1:] == fingerprint:
        return entry[0], False
    generation = _next_generation(state)
    state["objects"][name] = [generation, *fingerprint]
    return generation, True

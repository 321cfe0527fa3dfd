"""How every command-line entry point (`rlax` and each job's `python -m ...`) ends on an
error it expects: one line saying what went wrong and what to check, exit code 2, instead
of a 60-line traceback. `rlax --debug` (or RLAX_DEBUG=1, which jobs inherit) shows the
traceback instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence

import yaml

from pipeline.config import ConfigError
from pipeline.errors import ArgumentError
from pipeline.sandbox import SandboxError
from pipeline.storage import ObjectNotFound, StorageError, StorageUrlError

# Exit code of an error a retry cannot fix (bad arguments, a bad task option, curated data
# the run cannot verify): the DAG task that started the job fails for good instead of
# retrying. Every job's expected errors end with it (`run_main`).
BAD_INPUT = 2

DEBUG_ENV = "RLAX_DEBUG"


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Network failures of the storage clients (imported lazily: they are heavy)."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    with contextlib.suppress(ImportError):
        import requests

        found.append(requests.exceptions.RequestException)
    with contextlib.suppress(ImportError):
        from google.api_core import exceptions as gexc

        found.append(gexc.GoogleAPIError)
    return tuple(found)


def describe(err: BaseException) -> str | None:
    """One line for an expected error; None for a bug (it keeps its traceback)."""
    from pipeline.paramserver.adapters import BaseMismatchError
    from pipeline.run import RunError

    if isinstance(err, ArgumentError):
        return f"bad argument: {err}"
    if isinstance(err, ConfigError):
        return f"config error: {err}"
    if isinstance(err, StorageUrlError):
        return f"bad storage URL: {err}"
    if isinstance(err, (RunError, BaseMismatchError)):  # names both digests, what to do
        return str(err)
    if isinstance(err, SandboxError):  # names the sandbox or service, and what to do
        return f"sandbox error: {err}"
    if isinstance(err, yaml.YAMLError):
        return f"invalid YAML: {str(err).splitlines()[0]} (check the file's indentation)"
    if isinstance(err, ObjectNotFound):
        return f"not found in the store: {err} (check the run URL)"
    if isinstance(err, (StorageError, *_transport_errors())):
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        where = f"STORAGE_EMULATOR_HOST={emulator}" if emulator else "credentials (gcloud auth)"
        return (
            f"storage unreachable or refusing: {type(err).__name__}: {err} (check the run URL, "
            f"the network and {where}; it is retried with backoff before this)"
        )
    return None


def run_main(prog: str, main: Callable[[Sequence[str] | None], int], argv=None) -> int:
    """main(argv), with expected errors reduced to one line on stderr (exit code BAD_INPUT)."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        line = None if os.environ.get(DEBUG_ENV) == "1" else describe(err)
        if line is None:
            raise
        print(f"{prog}: {line}", file=sys.stderr, flush=True)
        return BAD_INPUT

"""The operations wing: the `rlax` command, the launcher, the demo, chaos, the local
Airflow and the stack, the emulators and the sandbox service's HTTP server. It uses the
core library; the core never imports it (tests/test_imports.py)."""

from pathlib import Path

# The checkout (dags/, configs/, the working directory of every job): every module of the
# wing takes it from here, so moving a module cannot point it at the wrong folder.
PROJECT_ROOT = Path(__file__).resolve().parents[2]

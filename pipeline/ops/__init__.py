"""The operations wing: the `rlax` command, the launcher, the demo, chaos, the local
Airflow and the stack, and the sandbox service's HTTP server. It uses the core library;
the core never imports it (tests/test_imports.py)."""

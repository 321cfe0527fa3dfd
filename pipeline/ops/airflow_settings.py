"""The one table of Airflow settings, with a small override per shape.

Three shapes run the same DAGs: `local` (`rlax airflow`, `rlax demo --airflow`: `airflow
standalone` on SQLite with the LocalExecutor), `stack` (`rlax stack up`: PostgreSQL,
Redis, Celery workers, on this machine) and `compose` (docker-compose.yml, the same
services in containers). What they share is written once here; each shape's override
says only how it differs. Values that depend on one instance (ports, secrets, paths under
its home, connection strings) are filled in by the shape's own code: `airflow_local`,
`stack`; the compose file spells its values out and tests/dags/test_compose.py checks
them against `airflow_settings("compose")`.
"""

from __future__ import annotations

from pipeline.ops import PROJECT_ROOT

ADMIN = "admin"

# Every shape.
COMMON: dict[str, str] = {
    "AIRFLOW__CORE__DAGS_FOLDER": str(PROJECT_ROOT / "dags"),
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    # Airflow's default, said here: a DAG the user did not ask to run waits for them
    # (the triggered-only RLAX DAGs unpause themselves: `is_paused_upon_creation`).
    "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN}:admin",
}

# The production shape (stack and compose): Celery workers, PostgreSQL, Redis.
CELERY: dict[str, str] = {
    "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
    # Airflow's own retried database calls wait (0.5 s, 1 s, ... 5 s) this many times
    # (default 3: ~3 s): enough to ride out a database restart.
    "AIRFLOW__DATABASE__MAX_DB_RETRIES": "12",
    # The broker hands an unacknowledged task to another worker after this long (Celery's
    # default 24 h, then it terminates the first): longer than a training run.
    "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": "604800",
    # Task instances name the Celery worker (RLAX_NODE_NAME) that ran them (pipeline.queues).
    "AIRFLOW__CORE__HOSTNAME_CALLABLE": "pipeline.queues.node_hostname",
}

# Processes on this machine (local and stack): the API and the scheduler's unauthenticated
# health check bind loopback only (its default is 0.0.0.0:8974), on free ports.
LOOPBACK: dict[str, str] = {
    "AIRFLOW__API__HOST": "127.0.0.1",
    "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "True",
    "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_HOST": "127.0.0.1",
    "AIRFLOW__LOGGING__COLORED_CONSOLE_LOG": "False",
}

SHAPES: dict[str, dict[str, str]] = {
    "local": {
        **COMMON,
        **LOOPBACK,
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
    },
    "stack": {
        **COMMON,
        **CELERY,
        **LOOPBACK,
        # Triggered by the stack's drivers and tests as soon as the DAGs are parsed.
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        # A task whose worker vanished (no heartbeat) is failed, and so retried, after this
        # long (default 300 s): a preempted node's tasks come back soon
        # (RLAX_STACK_HEARTBEAT_TIMEOUT_S overrides it).
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "60",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
    },
    "compose": {
        **COMMON,
        **CELERY,
        "AIRFLOW__CORE__DAGS_FOLDER": "/opt/rlax/dags",  # the project, mounted
        "AIRFLOW__CORE__PARALLELISM": "16",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "120",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": "http://airflow-apiserver:8080/execution/",
        "AIRFLOW__API__BASE_URL": "http://127.0.0.1:8080",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": "/opt/airflow/passwords.json",
    },
}


def airflow_settings(shape: str) -> dict[str, str]:
    """The fixed AIRFLOW__* settings of `shape` (a copy: callers add their instance's)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown Airflow shape {shape!r}; allowed: {', '.join(SHAPES)}")
    return dict(SHAPES[shape])

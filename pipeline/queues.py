"""Celery queues of the RL roles (stdlib only: the DAG files import it when parsed).

With the CeleryExecutor the trainer's task goes to TRAINER_QUEUE and the rollout workers'
to ROLLOUT_QUEUE (dags/stage.py); each queue is served by its own Celery workers, so the
trainer's node and the rollout nodes are configuration (`rlax stack`, docker-compose.yml).
Every other task uses Airflow's default queue. The LocalExecutor and the
KubernetesExecutor ignore queues. Read when the DAG files are parsed: set the variables
in the environment of the DAG processor and the scheduler.
"""

from __future__ import annotations

import os

TRAINER_QUEUE = os.environ.get("RLAX_TRAINER_QUEUE", "trainer")
ROLLOUT_QUEUE = os.environ.get("RLAX_ROLLOUT_QUEUE", "rollout")
DEFAULT_QUEUE = os.environ.get("AIRFLOW__OPERATORS__DEFAULT_QUEUE", "default")

NODE_ENV = "RLAX_NODE_NAME"


def node_hostname() -> str:
    """The host a task instance reports (`[core] hostname_callable`): the machine's name, and
    the Celery worker's node name when several share one machine (`rlax stack` sets
    RLAX_NODE_NAME per worker), so the UI and the API say which worker ran each try."""
    import socket

    host = socket.getfqdn()
    node = os.environ.get(NODE_ENV)
    return f"{node}@{host}" if node else host

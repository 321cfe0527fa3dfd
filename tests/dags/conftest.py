"""Airflow in these tests reads a throwaway AIRFLOW_HOME, never the developer's ~/airflow.

Set before anything imports airflow (its configuration is read at import time)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DAGS = ROOT / "dags"

os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="rlax-airflow-tests-")
atexit.register(shutil.rmtree, os.environ["AIRFLOW_HOME"], ignore_errors=True)
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(DAGS)
os.environ["AIRFLOW__CORE__UNIT_TEST_MODE"] = "False"

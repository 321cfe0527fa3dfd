"""The Airflow UI as a first-time user meets it, in a real browser (marker `ui`).

`rlax airflow` (what `make airflow` runs) on a free port and a fresh AIRFLOW_HOME; headless
Chromium (Debian's `chromium` + `chromium-driver`) driven by selenium:

sign in with the password `rlax airflow` printed -> Dags -> rlax_rl_training -> Trigger ->
the form at its defaults but *Config file* = configs/tiny.yaml -> Trigger -> (the run
succeeds) -> the run's grid -> its Report tab (report.md rendered with its plots).

Fails on a disabled Trigger button, on any SEVERE browser console entry after signing in
(before it, Airflow's single-page app answers its own `/ui/config` with 401 and redirects
to the login page: that is how it finds out nobody is signed in), and when a step's
element does not appear. Screenshots of the form, the grid and the report, and the user's
clicks, keystrokes and times, go to `artefacts/ui/` (git-ignored).

Run by `.ci/run` after `make test` (`pytest -m ui tests/ui`); ~4-5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest

from dags.params import run_url_for
from pipeline.ops.airflow_local import RL_DAG_ID, LocalAirflow, plain
from tests.local_servers import free_port

pytestmark = pytest.mark.ui

ROOT = Path(__file__).resolve().parents[2]
ARTEFACTS = ROOT / "artefacts" / "ui"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
# The flags that keep Chromium off the network of a closed machine (docs/airflow.md).
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1300",
)
TINY = "configs/tiny.yaml"
WAIT_S = 60  # for one element of a page to appear


@pytest.fixture(scope="module")
def browser_binaries():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(p)]
    if missing:
        why = f"{missing} missing: apt-get install chromium chromium-driver (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


class User:
    """The browser, with a tally of what a person would do: clicks and keystrokes."""

    def __init__(self, driver, base_url: str) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver = driver
        self.base_url = base_url
        self.wait = WebDriverWait(driver, WAIT_S)
        self.clicks = 0
        self.keys = 0
        self.signed_in = False
        self.console: list[dict] = []

    def find(self, by: str, what: str, clickable: bool = True):
        from selenium.webdriver.support import expected_conditions as ec

        cond = ec.element_to_be_clickable if clickable else ec.presence_of_element_located
        return self.wait.until(cond((by, what)), f"no {what!r} on {self.driver.current_url}")

    def click(self, by: str, what: str):
        """One click on the element; found again if the page re-rendered it meanwhile
        (React redraws lists as their data arrives)."""
        from selenium.common.exceptions import StaleElementReferenceException

        for attempt in range(5):
            try:
                el = self.find(by, what)
                el.click()
                break
            except StaleElementReferenceException:
                if attempt == 4:
                    raise
                time.sleep(0.5)
        self.clicks += 1
        return el

    def type(self, el, text: str, *, keys: int | None = None) -> None:
        """Type `text`; `keys` counts what a person presses instead (a paste: 2)."""
        el.send_keys(text)
        self.keys += len(text) if keys is None else keys

    def screenshot(self, name: str) -> Path:
        ARTEFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTEFACTS / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def console_errors(self) -> list[dict]:
        """SEVERE console entries since the last call (the 401s of the signed-out app are
        Airflow's way to send a new visitor to the login page: not errors)."""
        errors = []
        for entry in self.driver.get_log("browser"):
            self.console.append(entry)
            if entry["level"] != "SEVERE":
                continue
            if not self.signed_in and "401 (Unauthorized)" in entry["message"]:
                continue
            errors.append(entry)
        return errors


@pytest.fixture(scope="module")
def airflow_ui(browser_binaries, tmp_path_factory):
    """`rlax airflow` on a free port: (base URL, admin password, seconds to ready)."""
    home = tmp_path_factory.mktemp("airflow_ui_home")
    out = home / "rlax-airflow.out"
    t0 = time.monotonic()
    with open(out, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.ops.cli", "airflow", "--port", str(free_port())]
            + ["--home", str(home)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        deadline = time.monotonic() + 300
        printed = ""
        while "Ctrl-C stops it" not in printed:
            assert proc.poll() is None, f"rlax airflow exited:\n{out.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not up in 300 s:\n{printed[-3000:]}"
            time.sleep(0.5)
            printed = out.read_text(errors="replace")
        url = re.search(r"Airflow UI: (http://127\.0\.0\.1:\d+)", printed).group(1)
        password = re.search(r"password: (\S+)", printed).group(1)
        yield url, password, time.monotonic() - t0
    finally:
        # SIGTERM, which `rlax airflow` takes as Ctrl-C: it stops Airflow's process group.
        # (Not SIGINT: a shell that starts CI in the background makes its children ignore it.)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def user(airflow_ui):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="rlax-chromium-")
    options.add_argument(f"--user-data-dir={profile}")  # fresh: no state, no first-run
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield User(driver, airflow_ui[0])
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _api(url: str, password: str) -> LocalAirflow:
    """REST access to the running Airflow (the checks a user cannot see at a glance)."""
    af = LocalAirflow(port=int(url.rsplit(":", 1)[1]))
    af.password = password
    return af


@pytest.mark.timeout(480)
def test_first_time_user_triggers_the_tiny_run_and_reads_its_report(airflow_ui, user):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    url, password, ready_s = airflow_ui
    api = _api(url, password)
    d = user.driver
    t0 = time.monotonic()

    # ---- sign in: the URL from the terminal, user admin, the printed password
    d.get(url)
    user.clicks += 1  # the URL, clicked in the terminal
    user.type(user.find(By.NAME, "username"), "admin")
    user.clicks += 1  # into the field first
    password_box = user.find(By.NAME, "password")
    user.type(password_box, password, keys=2)  # pasted: Ctrl+V
    user.clicks += 2 + 1  # double-click the password in the terminal, click the field
    user.keys += 3  # Ctrl+Shift+C in the terminal
    user.type(password_box, Keys.ENTER, keys=1)
    user.find(By.CSS_SELECTOR, "a[href$='/dags']")
    assert user.console_errors() == []  # the signed-out app's 401s are let through here
    user.signed_in = True

    # ---- a fresh Airflow started nothing: rlax_retraining (weekly) waits, paused
    dags = {dag["dag_id"]: dag for dag in api.get("/dags?tags=rlax")["dags"]}
    assert dags["rlax_retraining"]["is_paused"] and not dags[RL_DAG_ID]["is_paused"]
    assert api.get("/dags/~/dagRuns")["total_entries"] == 0

    # ---- Dags -> rlax_rl_training -> Trigger (the DAG list may need the DAG processor)
    user.click(By.CSS_SELECTOR, "a[href$='/dags']")
    user.click(By.CSS_SELECTOR, f"a[href$='/dags/{RL_DAG_ID}']")
    user.click(By.CSS_SELECTOR, "button[aria-label='Trigger Dag']")
    trigger = _form_trigger_button(user)
    assert trigger.is_enabled(), "the form at its defaults cannot be submitted"
    defaults = (user.clicks, user.keys)  # a trigger with every default: one click more

    # ---- Config file = configs/tiny.yaml (its suggestion list has it), the rest as it is
    user.click(By.XPATH, "//button[@data-part='item-trigger'][normalize-space()='Run']")
    box = user.click(By.ID, "element_config_file")
    assert box.get_attribute("value") == "configs/demo.yaml"
    user.type(box, Keys.CONTROL + "a", keys=2)
    user.type(box, TINY)
    user.screenshot("1-trigger-form")
    assert user.console_errors() == []
    trigger = _form_trigger_button(user)
    assert trigger.is_enabled(), "Trigger disabled after choosing the tiny config"
    trigger.click()
    user.clicks += 1
    run_id = _wait_for_new_run(api)
    submitted_s = time.monotonic() - t0
    try:
        _follow_the_run(user, api, run_id)
    finally:
        _remove_run(run_url_for({}, run_id))
    numbers = {
        "airflow_ready_s": round(ready_s, 1),
        "browser_to_submitted_s": round(submitted_s, 1),
        "start_to_submitted_s": round(ready_s + submitted_s, 1),
        "clicks_keys_defaults": [defaults[0] + 1, defaults[1]],  # + the form's Trigger
        "clicks_keys_tiny": [user.clicks, user.keys],
        "run_id": run_id,
    }
    (ARTEFACTS / "numbers.json").write_text(json.dumps(numbers, indent=1) + "\n")
    print(f"first-time user: {numbers}")


def _follow_the_run(user: User, api: LocalAirflow, run_id: str) -> None:
    """After the trigger: the run succeeds; its grid; its Report tab; its log and assets."""
    from selenium.webdriver.common.by import By

    d = user.driver
    assert user.console_errors() == []

    # ---- the run, followed as a user would: its grid, until it succeeds
    state = api.wait_for_run(RL_DAG_ID, run_id, timeout=330, poll_s=3)
    failed = [
        t["task_id"]
        for t in map(plain, api.task_instances(RL_DAG_ID, run_id))
        if t["state"] != "success"
    ]
    assert state == "success", f"run {run_id} {state}; not successful: {failed}"
    d.get(f"{user.base_url}/dags/{RL_DAG_ID}/runs/{quote(run_id, safe='')}")
    user.find(By.XPATH, "//*[normalize-space()='report']", clickable=False)
    time.sleep(1)  # the grid's boxes are drawn after its rows
    user.screenshot("2-run-grid")
    assert user.console_errors() == []

    # ---- one click: the run's Report tab (the plugin's page in an iframe)
    user.click(By.XPATH, "//a[normalize-space()='Report'] | //button[normalize-space()='Report']")
    frame = user.find(By.CSS_SELECTOR, "iframe[title='Report']", clickable=False)
    d.switch_to.frame(frame)
    table = user.find(By.TAG_NAME, "table", clickable=False)
    page = d.find_element(By.TAG_NAME, "body").text
    assert "Held-out evaluation per version" in page and "pass@1" in table.text, page[:2000]
    plots = d.find_elements(By.TAG_NAME, "img")
    assert plots, "the report shows no plot"
    user.wait.until(
        lambda drv: all(drv.execute_script("return arguments[0].complete", p) for p in plots)
    )
    widths = [d.execute_script("return arguments[0].naturalWidth", p) for p in plots]
    assert all(w > 100 for w in widths), f"a plot did not load: {widths}"
    d.execute_script("arguments[0].scrollIntoView()", plots[0])  # the screenshot shows one
    d.switch_to.default_content()
    user.screenshot("3-report-tab")
    assert user.console_errors() == []

    # ---- what the task log and the Assets page hold for this run
    log = api.task_log(RL_DAG_ID, run_id, "report", 1)
    assert re.search(r"v0 +\| .*\n.*v\d+ +\|", log) and "points" in log, log[-3000:]
    query = urlencode({"source_dag_id": RL_DAG_ID, "source_run_id": run_id})
    events = api.get(f"/assets/events?{query}")
    kinds = {e["uri"].rsplit("/", 1)[-1]: e["extra"] for e in events["asset_events"]}
    assert set(kinds) == {"weights", "eval", "report"}, kinds
    run_url = run_url_for({}, run_id)  # the defaults: storage root runs/, run id empty
    assert all(extra["run"] == run_url for extra in kinds.values()), kinds
    assert kinds["report"]["report"].endswith(f"{run_url}/report/report.md")
    assert kinds["weights"]["step"] == 4  # configs/tiny.yaml's trainer.steps
    assert kinds["eval"]["versions"] == [0, 4] and "v4" in kinds["eval"]["pass@1"]


def _form_trigger_button(user: User):
    """The Trigger button at the foot of the trigger form (the dialog's last 'Trigger')."""
    from selenium.webdriver.common.by import By

    xpath = "//*[@role='dialog']//button[normalize-space()='Trigger']"
    user.find(By.XPATH, xpath, clickable=False)
    return user.driver.find_elements(By.XPATH, xpath)[-1]


def _wait_for_new_run(api: LocalAirflow, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = api.get(f"/dags/{RL_DAG_ID}/dagRuns")["dag_runs"]
        if runs:
            assert len(runs) == 1, runs
            assert runs[0]["conf"].get("config_file") == TINY, runs[0]["conf"]
            return runs[0]["dag_run_id"]
        time.sleep(0.5)
    raise AssertionError("the form's Trigger started no run")


def _remove_run(run_url: str) -> None:
    """The run lies under the default storage root (`runs/` of the project): remove it."""
    path = Path(run_url)
    assert path.is_absolute(), run_url
    if path.is_relative_to(ROOT / "runs") and path.name.startswith("airflow-"):
        shutil.rmtree(path, ignore_errors=True)

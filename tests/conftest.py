"""Suite-wide settings and fixtures.

Hypothesis runs derandomized: the same examples on every run, so CI is reproducible (a failure
reproduces locally with the same command). Set ``HYPOTHESIS_PROFILE=explore`` to draw fresh
random examples when hunting for bugs.

PostgreSQL (``postgres_server``, ``postgres_admin``, ``postgres_db``; used by tests/registry and
tests/flows): a real server for the session, Debian's PostgreSQL (``apt-get install postgresql``),
started from its binaries in a temporary directory on a free port on 127.0.0.1, as the
``postgres`` OS user when the tests run as root (PostgreSQL refuses to run as root), and stopped at
the end of the session. It starts only when a test asks for it. Set ``ASYNCRL_TEST_POSTGRES_URL``
(a server URL without a database, e.g. ``postgresql+psycopg://postgres@127.0.0.1:5432``) to use a
running server instead.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings

from training.engines.ports import free_port

settings.register_profile("default", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


_OWN_HOME: list[str | None] = [None]  # the temporary state directory this session made


def pytest_configure(config):
    """Keep test state out of the working tree: unless the caller set ASYNCRL_HOME, every test
    that does not choose its own state directory shares one temporary directory."""
    if "ASYNCRL_HOME" not in os.environ:
        os.environ["ASYNCRL_HOME"] = _OWN_HOME[0] = tempfile.mkdtemp(prefix="asyncrl-test-home-")
    # as every entry point does: configure Prefect/MLflow/Ray before any test imports them
    from flows.environment import configure

    configure()


def pytest_unconfigure(config):
    """Remove the temporary state directory pytest_configure made, so test sessions leave no
    asyncrl-test-home-* behind (a server still ending with this process keeps its open files
    until it exits)."""
    if _OWN_HOME[0]:
        shutil.rmtree(_OWN_HOME[0], ignore_errors=True)


# --- PostgreSQL ---------------------------------------------------------------------------------

PG_USER = "postgres"
PG_DATABASE = "asyncrl_test"
INSTALL_HINT = "apt-get install -y postgresql"
ROOT_PREFIX = "asyncrl-pg-"
_counter = itertools.count()


def _pg_bin_dir() -> Path | None:
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path else None


def _as_postgres(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    return ["runuser", "-u", PG_USER, "--", *cmd]


def _run(cmd: list[str], what: str) -> None:
    out = subprocess.run(_as_postgres(cmd), capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        tail = " ".join((out.stdout + out.stderr).split())[-400:]
        pytest.fail(f"{what} failed (exit {out.returncode}): {tail}", pytrace=False)


@pytest.fixture
def fresh_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``ASYNCRL_HOME`` set to a new ``tmp_path/home`` for the test (warm starts and state are
    the test's own), restored afterwards."""
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the module (FACTS.md: start Ray once, not per test), loopback-only,
    2 CPUs (two rank bundles for Megatron's world size 2), reaped with this process. Shut down at
    the module's end: a later module that starts its own Ray would fail beside a session-wide one.
    (tests/training/runtime overrides it to give the module its own ``ASYNCRL_HOME`` first.)"""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from training.ray_setup import init_ray

    init_ray(num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def postgres_server() -> str:
    """The SQLAlchemy URL of a PostgreSQL server (no database part) for this test session."""
    external = os.environ.get("ASYNCRL_TEST_POSTGRES_URL")
    if external:
        yield external.rstrip("/")
        return
    yield from _local_server()


def _stop(pg_ctl: str, data: Path) -> None:
    """Stop the server of ``data`` (pg_ctl; if that fails, kill the PID it wrote)."""
    stop = subprocess.run(
        _as_postgres([pg_ctl, "-D", str(data), "-m", "immediate", "-w", "-t", "30", "stop"]),
        capture_output=True, text=True, timeout=60,
    )
    pid_file = data / "postmaster.pid"
    if stop.returncode != 0 and pid_file.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap_orphans(pg_ctl: str) -> None:
    """Stop servers that an earlier test session of this fixture started and could not stop
    (it was killed): each temp dir names the PID of its session in ``owner.pid``."""
    for root in Path(tempfile.gettempdir()).glob(f"{ROOT_PREFIX}*"):
        owner = root / "owner.pid"
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            continue
        if _alive(pid):
            continue
        if (root / "data" / "postmaster.pid").exists():
            _stop(pg_ctl, root / "data")
        shutil.rmtree(root, ignore_errors=True)


def _local_server():
    bin_dir = _pg_bin_dir()
    if bin_dir is None:
        pytest.fail(
            f"PostgreSQL server binaries (pg_ctl, initdb) not found; install them: {INSTALL_HINT}",
            pytrace=False,
        )
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam(PG_USER)
        except KeyError:
            pytest.fail(f"no '{PG_USER}' OS user to run the server as; {INSTALL_HINT}",
                        pytrace=False)
    pg_ctl = str(bin_dir / "pg_ctl")
    _reap_orphans(pg_ctl)
    root = Path(tempfile.mkdtemp(prefix=ROOT_PREFIX))
    (root / "owner.pid").write_text(str(os.getpid()))
    data, sock, log = root / "data", root / "sock", root / "server.log"
    sock.mkdir()
    if os.geteuid() == 0:
        for path in (root, sock):
            os.chown(path, pw.pw_uid, pw.pw_gid)
    port = free_port()
    started = False
    try:
        _run([str(bin_dir / "initdb"), "-D", str(data), "-U", PG_USER, "-A", "trust",
              "-E", "UTF8", "--locale=C", "--no-sync"], "initdb")
        options = (f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off")
        _run([pg_ctl, "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start"],
             f"pg_ctl start (log: {log})")
        started = True
        yield f"postgresql+psycopg://{PG_USER}@127.0.0.1:{port}"
    finally:
        if started:
            _stop(pg_ctl, data)
        shutil.rmtree(root, ignore_errors=True)


def _admin_execute(server_url: str, sql: str) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(f"{server_url}/postgres", isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(sql))
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def postgres_admin(postgres_server) -> Callable[[str], None]:
    """Run one SQL statement (``CREATE DATABASE`` ...) on the session server's ``postgres``
    database, outside a transaction."""
    return functools.partial(_admin_execute, postgres_server)


@pytest.fixture
def postgres_db(postgres_server, postgres_admin) -> str:
    """The URL of a fresh, empty database on the session's server (``asyncrl_test_<pid>_<n>``),
    dropped after the test."""
    name = f"{PG_DATABASE}_{os.getpid()}_{next(_counter)}"
    postgres_admin(f'CREATE DATABASE "{name}"')
    yield f"{postgres_server}/{name}"
    postgres_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def services_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh ``ASYNCRL_HOME`` with no service URLs inherited from the environment, for tests
    of ``asyncrl up``/``down`` and the tracking servers; afterwards, whatever server a failed test
    left running is stopped by its recorded process group."""
    import json

    from ui import services_cli

    home = tmp_path / "home"
    monkeypatch.setenv("ASYNCRL_HOME", str(home))
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "PREFECT_API_URL",
                "ASYNCRL_REGISTRY_URL", "ASYNCRL_MLFLOW_UI_URL"):
        monkeypatch.delenv(var, raising=False)
    yield home
    record = home / "services.json"
    if record.is_file():
        for entry in json.loads(record.read_text()).values():
            if services_cli._is_ours(entry):
                services_cli._stop_groups([entry["pgid"]], grace=5.0)


@pytest.fixture(autouse=True)
def _preflight_checked_afresh():
    """``preflight`` remembers recipes that passed in this process (training/runtime/run.py);
    a test that changes what the checks see (a faked install, another directory) must not
    inherit a pass from an earlier test, so each test starts with none remembered."""
    run = sys.modules.get("training.runtime.run")  # not imported here: it costs start-up
    if run is not None:
        run._PREFLIGHT_PASSED.clear()
    yield


# --- the dashboard in a real browser ------------------------------------------------------------

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


class Browser:
    """Debian's chromium, headless, driven through Selenium by Debian's chromedriver (no browser
    download). :meth:`open` loads a page and fails the test on any JavaScript error or failed
    resource the page logged; :meth:`shot` saves a screenshot under ``out`` (the test's
    artifacts) and, when ``ASYNCRL_SCREENSHOT_DIR`` is set, there too (how the docs' images are
    made)."""

    def __init__(self, driver, out: Path) -> None:
        self.driver, self.out = driver, out

    def errors(self) -> list[str]:
        return [e["message"] for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]

    def open(self, url: str, wait_for: str | None = None, timeout: float = 30.0):
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver.get(url)
        if wait_for:
            WebDriverWait(self.driver, timeout).until(
                lambda d: d.find_elements(By.CSS_SELECTOR, wait_for))
        errors = self.errors()
        assert not errors, f"{url}: the page logged errors: {errors}"
        return self.driver

    def shot(self, name: str, height: int | None = None) -> Path:
        d = self.driver
        if height is None:  # the whole page
            height = int(d.execute_script("return document.documentElement.scrollHeight"))
        d.set_window_size(1400, min(max(height, 600), 6000))
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / name
        assert d.save_screenshot(str(path)), f"no screenshot {path}"
        extra = os.environ.get("ASYNCRL_SCREENSHOT_DIR")
        if extra:
            Path(extra).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(extra) / name)
        d.set_window_size(1400, 1000)
        return path


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory):
    """A :class:`Browser` for the session (quit at its end)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(p)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: install Debian's chromium and "
                    "chromium-driver (the README's test command does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield Browser(driver, tmp_path_factory.mktemp("screenshots"))
    finally:
        driver.quit()


@contextlib.contextmanager
def _dashboard_server(home: Path, extra_args: tuple[str, ...] = ()):
    """``python -m ui.dashboard`` on a free port reading ``home``'s registry, as ``asyncrl up``
    starts it; yields its base URL and stops it (its process group, by PID) on exit."""
    import time

    import httpx

    port = free_port()
    env = {**os.environ, "ASYNCRL_HOME": str(home)}
    for var in ("ASYNCRL_REGISTRY_URL", "MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        env.pop(var, None)
    log = open(Path(home) / "dashboard-test.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "ui.dashboard", "--port", str(port),
                             *extra_args], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None, (Path(home) / "dashboard-test.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the dashboard did not start within 90 s"
            time.sleep(0.3)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log.close()


@pytest.fixture(scope="session")
def dashboard_server():
    """The context manager above."""
    return _dashboard_server

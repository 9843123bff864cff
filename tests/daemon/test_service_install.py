"""README's service install, followed as written on this host: `systemd/install.sh`, then the unit *as shipped*.

It changes the host (a `cbd` user, /opt/cbd, /etc/cbd, /etc/systemd/system/cbd.service), so it runs only as
root and only where asked: CI=true (a throw-away machine) or CBD_TEST_SERVICE_INSTALL=1. Without systemd
as PID 1, the unit's start is reproduced from the unit file itself: ExecStart, User, Group and
Environment= as written, with the RuntimeDirectory and CacheDirectory systemd would create.
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from cbd.engine.kv import session_files
from cbd_client import Client

ROOT = Path(__file__).parents[2]
UNIT = ROOT / "systemd" / "cbd.service"
GATEWAY_UNIT = ROOT / "systemd" / "cbd-openai.service"
INSTALLED_UNIT = Path("/etc/systemd/system/cbd.service")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not (os.environ.get("CI") == "true" or os.environ.get("CBD_TEST_SERVICE_INSTALL") == "1"),
        reason="installs a system service: root, with CI=true or CBD_TEST_SERVICE_INSTALL=1",
    ),
]


def unit_values(text: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            values.setdefault(key.strip(), []).append(value.strip())
    return values


@pytest.fixture(scope="module")
def installed() -> Path:
    proc = subprocess.run(["bash", str(ROOT / "systemd" / "install.sh"), "--no-start"], capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return INSTALLED_UNIT


def test_the_unit_is_installed_unmodified_and_verifies(installed) -> None:
    assert installed.read_bytes() == UNIT.read_bytes()
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    proc = subprocess.run([analyze, "verify", str(installed)], capture_output=True, text=True, timeout=120)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if "cbd.service" in line]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr
    values = unit_values(UNIT.read_text())
    doc = values["Documentation"][0].removeprefix("file://")
    assert Path(doc).is_file(), doc
    assert "--listen" not in values["ExecStart"][0] and "--socket-group" not in values["ExecStart"][0]


def test_the_service_starts_as_its_user_and_serves_on_the_documented_socket(installed) -> None:
    values = unit_values(installed.read_text())
    user, group = values["User"][0], values["Group"][0]
    account = pwd.getpwnam(user)
    runtime = Path("/run") / values["RuntimeDirectory"][0]
    cache = Path("/var/cache") / values["CacheDirectory"][0]
    state = Path("/var/lib") / values["StateDirectory"][0]
    shutil.rmtree(state / "sessions", ignore_errors=True)  # none left by an earlier run on this machine
    for directory, mode in ((runtime, int(values["RuntimeDirectoryMode"][0], 8)), (cache, 0o755), (state, 0o755)):
        directory.mkdir(parents=True, exist_ok=True)
        os.chown(directory, account.pw_uid, account.pw_gid)
        directory.chmod(mode)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": account.pw_dir, "RUNTIME_DIRECTORY": str(runtime),
           "CACHE_DIRECTORY": str(cache), "STATE_DIRECTORY": str(state), "NOTIFY_SOCKET": ""}  # fmt: skip
    for assignment in values.get("Environment", []):
        key, value = assignment.split("=", 1)
        env[key] = value
    command = shlex.split(values["ExecStart"][0])
    # setpriv execs the daemon itself (no intermediate process), so SIGTERM reaches it as systemd's stop would.
    process = subprocess.Popen(["setpriv", f"--reuid={user}", f"--regid={group}", "--init-groups", "--", "env", "-i",
                                *[f"{k}={v}" for k, v in env.items()], *command],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    sock = runtime / "cbd.sock"
    try:
        with Client(f"unix:{sock}", timeout=120) as client:
            deadline = time.monotonic() + 600
            while not sock.exists() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            info = client.wait_ready(600)  # the first start converts the embedded model
            assert info.model.startswith("SmolLM2-135M-Instruct")
            reply = client.generate(
                [{"role": "user", "content": "What is the capital of France?"}], max_tokens=16, temperature=0.0
            )
            assert "Paris" in reply.text
            session = client.session([{"role": "system", "content": "Be brief."}], session_id="kept-across-restarts")
            session.send([{"role": "user", "content": "Hi."}], max_tokens=4, temperature=0.0)
            _check_gateway_unit(user, group)
        st = sock.stat()
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == account.pw_gid and st.st_uid == account.pw_uid
    finally:
        process.terminate()
        output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output
    assert not sock.exists()
    # The open sessions (ours and the gateway's) were saved at the stop, in the state directory's sessions folder
    # (in the daemon's own folder, its owner name), as the service's user.
    saved = list((state / "sessions").rglob("*.session"))
    keys = {session_files.read_header(path)[0].key.rsplit("/", 1)[-1] for path in saved}
    assert "kept-across-restarts" in keys, output
    assert all(path.stat().st_uid == account.pw_uid for path in saved), output
    shutil.rmtree(state / "sessions")


def _check_gateway_unit(user: str, group: str) -> None:
    """The gateway's unit, installed unmodified, verifies; its ExecStart as its user serves the daemon's model."""
    installed = Path("/etc/systemd/system/cbd-openai.service")
    assert installed.read_bytes() == GATEWAY_UNIT.read_bytes()
    analyze = shutil.which("systemd-analyze")
    if analyze is not None:
        proc = subprocess.run([analyze, "verify", str(installed)], capture_output=True, text=True, timeout=120)
        assert not [line for line in (proc.stdout + proc.stderr).splitlines() if "cbd-openai.service" in line], (
            proc.stdout + proc.stderr
        )
    values = unit_values(installed.read_text())
    assert values["User"] == [user] and values["Group"] == [group]
    command = shlex.split(values["ExecStart"][0])
    for name in values.get("StateDirectory", []):  # what systemd makes before ExecStart
        state = Path("/var/lib", name)
        state.mkdir(mode=0o750, exist_ok=True)
        shutil.chown(state, user, group)
    assert command[command.index("--state-dir") + 1] == "/var/lib/cbd-openai"
    gateway = subprocess.Popen(["setpriv", f"--reuid={user}", f"--regid={group}", "--init-groups", "--", "env", "-i",
                                "PATH=/usr/local/bin:/usr/bin:/bin", *command],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    listen = command[command.index("--listen") + 1]
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://{listen}/v1/models", timeout=5) as response:
                    models = json.load(response)
                break
            except OSError:
                assert gateway.poll() is None and time.monotonic() < deadline, (
                    gateway.stdout.read() if gateway.stdout else ""
                )
                time.sleep(0.2)
        assert models["data"][0]["id"].startswith("SmolLM2-135M-Instruct")
        body = {"model": "cbd", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16, "temperature": 0}  # fmt: skip
        request = urllib.request.Request(f"http://{listen}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as response:
            assert "Paris" in json.load(response)["choices"][0]["message"]["content"]
        body = {"model": "cbd", "input": "Say hi.", "max_output_tokens": 4}
        request = urllib.request.Request(f"http://{listen}/v1/responses", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as response:
            assert json.load(response)["status"] in ("completed", "incomplete")
        assert Path("/var/lib/cbd-openai/responses.sqlite3").exists()  # stored where the unit keeps state
    finally:
        gateway.terminate()
        gateway.communicate(timeout=60)


def test_the_replica_and_envoy_units_and_envoy_are_installed(installed, tmp_path) -> None:
    """README's "Several replicas behind Envoy" as services: the units as shipped, Envoy in the venv, and the
    bootstrap written by the installed envoy.py accepted by that Envoy."""
    for name in ("cbd@.service", "cbd-envoy.service"):
        assert Path("/etc/systemd/system", name).read_bytes() == (ROOT / "systemd" / name).read_bytes()
    envoy = Path("/opt/cbd/bin/envoy")
    assert os.access(envoy, os.X_OK)
    assert "/opt/cbd/bin/envoy" in unit_values((ROOT / "systemd" / "cbd-envoy.service").read_text())["ExecStart"][0]
    bootstrap = subprocess.run(["/opt/cbd/bin/python", "/opt/cbd/share/cbd/envoy.py", "--listen", "127.0.0.1:50051",
                                "unix:/run/cbd-0/cbd.sock", "unix:/run/cbd-1/cbd.sock"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bootstrap.returncode == 0, bootstrap.stderr
    config = tmp_path / "envoy.json"
    config.write_text(bootstrap.stdout)
    check = subprocess.run([str(envoy), "--mode", "validate", "-c", str(config)], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr

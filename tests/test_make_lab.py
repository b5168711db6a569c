"""The README's first command, `make lab`, starts JupyterLab on chapters/, listening on loopback."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port nobody listens on right now (on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_lab_serves_the_chapters_on_loopback(tmp_path):
    port = free_port()
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_CONFIG_DIR=str(tmp_path / "config"))
    # An empty token lets the test read the contents API; the learner's `make lab` keeps Jupyter's token.
    proc = subprocess.Popen(["make", "-s", "lab", f"PORT={port}", "LAB_ARGS=--no-browser --ServerApp.token="],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        listing, deadline = None, time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents", timeout=5) as resp:
                    listing = json.load(resp)
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        assert listing is not None, f"JupyterLab did not answer on 127.0.0.1:{port}"
        names = {item["name"] for item in listing["content"]}
        assert "01_precision_basics.ipynb" in names and "00_index.ipynb" in names
        with socket.socket() as s:  # loopback only: the machine's other addresses are not served
            s.settimeout(2)
            other = socket.gethostbyname(socket.gethostname())
            if not other.startswith("127."):
                assert s.connect_ex((other, port)) != 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

"""The README's first command, `make lab`: learner copies in workspace/, JupyterLab at the repository root
(workspace/ and chapters/ side by side), listening on loopback, kernels with one OpenMP thread.

It runs the real target, so it makes workspace/ in this checkout if it is missing, exactly as a
learner's first `make lab` does (copies that exist are kept).
"""

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


def api(port: int, path: str, method: str = "GET") -> dict | list:
    """One call to the server's REST API (empty token)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


def kernel_environ(kernel_id: str, deadline: float) -> dict[str, str]:
    """The environment of the kernel process with this id (its command line names the connection file)."""
    while time.monotonic() < deadline:
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
                if "ipykernel" in cmd and kernel_id in cmd:
                    raw = (proc / "environ").read_bytes().split(b"\0")
                    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
            except OSError:
                continue
        time.sleep(0.5)
    raise AssertionError(f"no process for kernel {kernel_id}")


def test_make_lab_serves_the_workspace_and_chapters_on_loopback(tmp_path):
    port = free_port()
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_CONFIG_DIR=str(tmp_path / "config"))
    # An empty token (and no XSRF check) lets the test call the REST API; a learner's `make lab` keeps both.
    env.pop("OMP_NUM_THREADS", None)  # what a learner's shell has: make lab must set it for the kernels
    proc = subprocess.Popen(["make", "-s", "lab", f"PORT={port}", "LAB_ARGS=--no-browser --ServerApp.token= --ServerApp.disable_check_xsrf=True"],
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
        assert {"chapters", "workspace"} <= names
        copies = {item["name"] for item in api(port, "/api/contents/workspace")["content"]}
        chapters = {p.name for p in (ROOT / "chapters").glob("*.ipynb")}
        assert chapters <= copies, f"learner copies missing: {chapters - copies}"
        kernel = api(port, "/api/kernels", "POST")  # the kernel a notebook gets in this JupyterLab
        if Path("/proc/self/environ").exists():
            assert kernel_environ(kernel["id"], time.monotonic() + 60).get("OMP_NUM_THREADS") == "1"
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

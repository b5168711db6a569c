"""The README's first command, `make lab`: learner copies in workspace/, JupyterLab at the repository root
(workspace/ and chapters/ side by side) opening on the learner's index, the full chapters read-only, one kernel,
listening on loopback, kernels with one OpenMP thread. The rules themselves (tools/lab_config.py) are tested
without a server first.

It runs the real target, so it makes workspace/ in this checkout if it is missing, exactly as a
learner's first `make lab` does (copies that exist are kept).
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest

import lab_config  # tools/ (tests/conftest.py puts it on sys.path)

pytestmark = pytest.mark.starts_first  # minutes in one module: pytest-xdist starts it first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path, read_only", [("chapters/01_x.ipynb", True), ("/chapters", True), ("chapters", True),
                                             ("workspace/01_x.ipynb", False), ("chapters_old/x.ipynb", False),
                                             ("", False), ("workspace/chapters/x.ipynb", False)])
def test_only_the_full_chapters_are_read_only(path, read_only):
    assert lab_config.is_read_only(path) is read_only


def test_lab_opens_on_the_learners_index(tmp_path):
    assert lab_config.default_url(str(tmp_path / "workspace"), str(tmp_path)) == "/lab/tree/workspace/00_index.ipynb"
    assert lab_config.default_url(str(tmp_path / "my work"), str(tmp_path)) == "/lab/tree/my%20work/00_index.ipynb"
    assert lab_config.default_url("workspace", str(tmp_path)) == "/lab/tree/workspace/00_index.ipynb"  # under root
    assert lab_config.default_url("/elsewhere", str(tmp_path)) == "/lab"  # outside the served folder


def test_saving_without_widget_state_keeps_the_run_this_cell_hint():
    from ampcourse.widgets import STORED_HINT, format_explorer

    data = format_explorer()._repr_mimebundle_()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("w", outputs=[nbformat.v4.new_output("display_data", data=data)])]
    model = {"type": "notebook", "content": json.loads(nbformat.writes(nb))}
    lab_config.pre_save(model, "workspace/01.ipynb")
    kept = model["content"]["cells"][0]["outputs"][0]["data"]
    assert lab_config.WIDGET_VIEW not in kept and STORED_HINT in kept["text/plain"]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}  # saved on purpose
    nb.cells[0].outputs[0].data = data
    assert lab_config.strip_widget_views(json.loads(nbformat.writes(nb))) == 0


def test_the_contents_manager_refuses_to_write_the_chapters(tmp_path):
    from tornado.web import HTTPError

    (tmp_path / "chapters").mkdir()
    (tmp_path / "workspace").mkdir()
    nb = nbformat.v4.new_notebook()
    nbformat.write(nb, tmp_path / "chapters" / "01.ipynb")
    before = (tmp_path / "chapters" / "01.ipynb").read_bytes()
    manager = lab_config.course_contents_manager()(root_dir=str(tmp_path))

    async def scenario():
        model = await manager.get("chapters/01.ipynb")
        assert model["writable"] is False
        listing = await manager.get("")
        assert {c["name"]: c["writable"] for c in listing["content"]} == {"chapters": False, "workspace": True}
        for call in (manager.save({"type": "notebook", "content": model["content"], "format": "json"}, "chapters/01.ipynb"),
                     manager.rename_file("chapters/01.ipynb", "chapters/02.ipynb"),
                     manager.delete_file("chapters/01.ipynb"),
                     manager.save({"type": "file", "content": "x", "format": "text"}, "chapters/new.txt")):
            with pytest.raises(HTTPError) as err:
                await call
            assert err.value.status_code == 403
        saved = await manager.save({"type": "notebook", "content": model["content"], "format": "json"}, "workspace/01.ipynb")
        assert saved["writable"] is True

    asyncio.run(scenario())
    assert (tmp_path / "chapters" / "01.ipynb").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "chapters").iterdir()) == ["01.ipynb"]


def test_the_refusal_offers_the_workspace_not_the_action_that_looped():
    """Issue 28 item 15: the refusal said "or File > Save As", the very action that had proposed chapters/ again."""
    text = lab_config.refusal("chapters/06_loss_scaling.ipynb")
    assert "workspace/edited_06_loss_scaling.ipynb" in text and "workspace/06_loss_scaling.ipynb" in text
    assert "File > Save As" not in text


def test_the_course_python_comes_first_on_path_once():
    first = lab_config.environment_bin()
    assert first == os.path.dirname(sys.executable)
    assert lab_config.put_first_on_path(first, f"/usr/bin:{first}:/bin").split(os.pathsep) == [first, "/usr/bin", "/bin"]
    assert lab_config.put_first_on_path(first, None) == first


def test_configure_sets_path_terminal_and_the_front_end_extension(monkeypatch, tmp_path):
    from traitlets.config import Config

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    c = Config()
    lab_config.configure(c, workspace="my work", root=str(tmp_path))
    assert os.environ["PATH"].split(os.pathsep)[0] == lab_config.environment_bin()  # kernels inherit it
    assert os.environ["AMPCOURSE_BIN"] == lab_config.environment_bin()
    command = c.ServerApp.terminado_settings["shell_command"]
    assert command[1:] == ["--rcfile", str(lab_config.TERMINAL_RC), "-i"] and lab_config.TERMINAL_RC.is_file()
    (ext,) = [Path(p) for p in c.LabApp.extra_labextensions_path]
    package = json.loads((ext / "ampcourse-lab" / "package.json").read_text())
    entry = ext / "ampcourse-lab" / package["jupyterlab"]["_build"]["load"]
    assert entry.is_file() and '_JUPYTERLAB[NAME] = container' in entry.read_text()
    page = c.ServerApp.tornado_settings["page_config_data"]["ampcourse"]
    assert page["workspace"] == "my work" and page["readOnly"] == ["chapters"] and page["prefix"] == "edited_"


@pytest.mark.skipif(not lab_config.terminal_command(), reason="no bash on this machine")
def test_the_terminal_runs_the_course_python_even_after_a_login_profile_and_the_users_bashrc(tmp_path):
    """Issue 28 item 13: JupyterLab's Terminal found another Python ("No module named 'ampcourse'")."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text('export PATH="/usr/bin:/bin:$PATH"\nexport FROM_BASHRC=1\n')  # as conda init would
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "AMPCOURSE_BIN": lab_config.environment_bin(), "TERM": "dumb"}
    probe = 'echo "$FROM_BASHRC $(command -v python3)"'
    run = subprocess.run([*lab_config.terminal_command(), "-c", probe], env=env, capture_output=True, text=True, timeout=30)
    mark, python = run.stdout.split()[-2:]
    assert mark == "1", "the learner's own ~/.bashrc was not read"
    assert python == os.path.join(lab_config.environment_bin(), "python3"), run.stdout + run.stderr
    plain = subprocess.run(["bash", "-i", "-c", probe], env=env, capture_output=True, text=True, timeout=30)
    assert plain.stdout.split()[-1] != python  # without the rc file: the other Python (what the learner hit)


def _line_done(seen: str, marker: str) -> bool:
    """Whether the output holds `marker` with the end of its line (the echoed command line spells it apart)."""
    at = seen.find(marker)
    return at >= 0 and "\n" in seen[at:]


def terminal_output(port: int, command: str, until: str, timeout: float = 60) -> str:
    """Run a command in a new JupyterLab Terminal (REST + websocket, as the Terminal tab does); its output."""
    from tornado.ioloop import IOLoop
    from tornado.websocket import websocket_connect

    name = api(port, "/api/terminals", "POST")["name"]

    async def talk() -> str:
        ws = await websocket_connect(f"ws://127.0.0.1:{port}/terminals/websocket/{name}")
        ws.write_message(json.dumps(["stdin", command + "\r"]))
        seen, deadline = "", time.monotonic() + timeout
        # until its whole line has come: the terminal may send "AMPOK" and the rest of that line in two messages
        while not _line_done(seen, until) and time.monotonic() < deadline:
            msg = await ws.read_message()
            if msg is None:
                break
            kind, *data = json.loads(msg)
            if kind == "stdout":
                seen += data[0]
        ws.close()
        return seen

    try:
        return IOLoop.current().run_sync(talk, timeout=timeout + 5)
    finally:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/terminals/{name}", method="DELETE")
        urllib.request.urlopen(req, timeout=10).close()  # 204: no body


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
    venv = Path(sys.prefix)  # the environment running this test: make must not rebuild it (-o: take it as built)
    proc = subprocess.Popen(["make", "-s", "-o", f"{venv}/.ampcourse-installed", "lab", f"VENV={venv}", f"PORT={port}",
                             "LAB_ARGS=--no-browser --ServerApp.token= --ServerApp.disable_check_xsrf=True"],
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
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as resp:  # where the browser lands
            assert resp.url.endswith("/lab/tree/workspace/00_index.ipynb"), resp.url
        specs = api(port, "/api/kernelspecs")
        assert list(specs["kernelspecs"]) == ["python3"], "one kernel on the Launcher"
        assert specs["kernelspecs"]["python3"]["spec"]["display_name"] == "ampcourse"
        assert api(port, "/api/contents/chapters/01_precision_basics.ipynb?content=0")["writable"] is False
        kernel = api(port, "/api/kernels", "POST")  # the kernel a notebook gets in this JupyterLab
        if Path("/proc/self/environ").exists():
            environ = kernel_environ(kernel["id"], time.monotonic() + 60)
            assert environ.get("OMP_NUM_THREADS") == "1"
            # `!python -m ampcourse...` in a cell: the course's Python first on the kernel's PATH
            assert environ["PATH"].split(os.pathsep)[0] == str(venv / "bin")
        # JupyterLab's Terminal: `python -m ampcourse...` runs the course's Python (issue 28, item 13)
        out = terminal_output(port, "python -c 'import ampcourse, sys; print(\"AMP\" + \"OK\", sys.executable)'", "AMPOK")
        assert f"AMPOK {venv / 'bin' / 'python'}" in out.replace("\r", ""), out[-500:]
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


def test_setup_installs_the_kernel_the_chapters_name():
    """`make setup` (so `make test` too, not only `make lab`) installs the one kernel the stored chapters name: else
    JupyterLab rewrites a chapter's kernelspec on open and marks it modified (seen in CI's fresh .venv)."""
    import sys

    from jupyter_client.kernelspec import KernelSpecManager

    from nbtool import KERNELSPEC

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    stamp_recipe = makefile.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "$(KERNEL_INSTALL)" in stamp_recipe, "the setup recipe must install the kernel"
    assert f"--name {KERNELSPEC['name']} --display-name {KERNELSPEC['display_name']}" in makefile
    if Path(sys.prefix, ".ampcourse-installed").exists():  # this interpreter is a .venv that `make setup` built
        spec = KernelSpecManager().get_kernel_spec(KERNELSPEC["name"])
        assert spec.display_name == KERNELSPEC["display_name"] and spec.env.get("OMP_NUM_THREADS") == "1"

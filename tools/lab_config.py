"""The course's JupyterLab settings, for `make lab` (``jupyter lab --config tools/lab_config.py``) and Binder.

- JupyterLab opens on the learner's index, ``workspace/00_index.ipynb`` (the folder `make lab` fills
  with learner copies; ``AMPCOURSE_WORKSPACE`` names another, as ``make lab WORKSPACE=...`` does).
- The full chapters (``chapters/``) are read-only: the contents API reports them as not writable, so
  JupyterLab shows its read-only mark and never autosaves a Run All there, and the server refuses a save,
  a rename or a delete there. The chapters in git stay as git has them (``git pull`` never conflicts).
- A notebook saved without widget state (JupyterLab's default) loses the live widget views from its
  outputs; what stays is the widget's text, the course's "run this cell ..." hint (``widgets.STORED_HINT``).
  Reopened later, the copy shows that hint, not "Error displaying widget: model not found".
- One kernel on the Launcher: ``python3``, the one every notebook asks for (shown as "ampcourse").
- The course environment's ``bin`` comes first on PATH for kernels and the Terminal (``environment_bin``), so
  ``!python -m ampcourse...`` in a cell and ``python -m ampcourse...`` in JupyterLab's Terminal run the course's
  Python; the Terminal is bash with ``tools/lab_terminal.bashrc`` (your ``~/.bashrc``, then that bin again).
- A small front-end extension (``tools/labextension/ampcourse-lab``, plain JavaScript, no build step): a full
  chapter's tab reads "[full] NAME", in italics (its learner copy has the same file name), and Save As from a full
  chapter, also the "Save as" JupyterLab offers when an edited one is closed, proposes
  ``workspace/edited_NAME`` instead of the read-only ``chapters/NAME``, which the server refuses.

Every rule is a plain function or class here, so tests use them without a server.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path, PurePosixPath
from urllib.parse import quote

READ_ONLY_DIRS = ("chapters",)  # relative to the server's root (the repository)
INDEX = "00_index.ipynb"
TOOLS = Path(__file__).resolve().parent  # Jupyter sets __file__ for a config file; Binder's exec passes it
sys.path.insert(0, str(TOOLS))
import nbtool  # noqa: E402  (the one home of the notebook rules: kernelspec, widget views)

WIDGET_VIEW = nbtool.WIDGET_VIEW
LABEXTENSIONS = TOOLS / "labextension"  # ampcourse-lab: the front-end rules (module docstring)
TERMINAL_RC = TOOLS / "lab_terminal.bashrc"
EDITED_PREFIX = "edited_"  # Save As from chapters/NAME proposes WORKSPACE/edited_NAME
TAB_MARK = "[full] "  # a full chapter's tab reads "[full] NAME" (its learner copy's: "NAME")
KERNEL = nbtool.KERNELSPEC["name"]  # the name every notebook asks for; `make lab` installs it as "ampcourse"


def is_read_only(path: str) -> bool:
    """Whether an API path ('chapters/01_x.ipynb', '/chapters') lies in a read-only folder (the folder itself too)."""
    parts = PurePosixPath("/" + str(path).strip("/")).parts[1:]
    return bool(parts) and parts[0] in READ_ONLY_DIRS


def default_url(workspace: str, root: str = ".") -> str:
    """The page JupyterLab opens: the learner's index in `workspace` (a relative one is under root), or the file browser."""
    rel = os.path.relpath(os.path.join(os.path.abspath(root), workspace), os.path.abspath(root))
    if rel.startswith(".."):  # a workspace outside the served folder cannot be opened from it
        return "/lab"
    return "/lab/tree/" + quote(PurePosixPath(*rel.split(os.sep), INDEX).as_posix())


def strip_widget_views(nb: dict) -> int:
    """Drop live widget views from a notebook's outputs when it stores no widget state; return how many.

    The output keeps its other data (text/plain: the widget's repr and the "run this cell" hint), which
    JupyterLab shows on reopening instead of an error.
    """
    if (nb.get("metadata") or {}).get("widgets"):  # state saved on purpose ("Save Widget State"): keep the views
        return 0
    dropped = 0
    for cell in nb.get("cells") or []:
        for out in cell.get("outputs") or []:
            if isinstance(out.get("data"), dict) and WIDGET_VIEW in out["data"]:
                nbtool.clean_widget_output(out)  # as `nbtool.py clean` stores a chapter's widget outputs
                dropped += 1
    return dropped


def pre_save(model: dict, path: str, **kwargs) -> None:
    """The contents manager's pre-save hook: strip widget views from notebooks."""
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict):
        strip_widget_views(model["content"])


def refusal(path: str, workspace: str = "workspace") -> str:
    """Why the server refuses to write a full chapter, and what to do instead (shown by JupyterLab's error dialog).

    It names the file Save As proposes there (``workspace/edited_NAME``), not "File > Save As", which is the
    very action that proposed this path before the course's extension and looped.
    """
    name = PurePosixPath(path).name
    return (f"{path} is a full chapter, read-only (it stays as git has it). Your own copy is {workspace}/{name}; "
            f"to keep these edits, Save As {workspace}/{EDITED_PREFIX}{name}, or close without saving")


def environment_bin() -> str:
    """The folder of the Python running JupyterLab (the course's .venv/bin, or Binder's), put first on PATH."""
    return str(Path(sys.executable).parent)


def put_first_on_path(folder: str, path: str | None) -> str:
    """PATH with folder first (once): kernels' `!python` and the Terminal's `python` are then the course's."""
    rest = [p for p in (path or "").split(os.pathsep) if p and os.path.normpath(p) != os.path.normpath(folder)]
    return os.pathsep.join([folder, *rest])


def terminal_command(shell: str | None = None) -> list[str] | None:
    """bash with the course's rc file (None without bash: the Terminal keeps its default shell and PATH)."""
    bash = shell or shutil.which("bash")
    return [bash, "--rcfile", str(TERMINAL_RC), "-i"] if bash else None


def course_contents_manager():
    """The server's contents manager with the read-only chapters (built lazily: jupyter_server imports here only)."""
    from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager
    from tornado import web

    def refuse(path: str) -> None:
        if is_read_only(path):
            raise web.HTTPError(403, refusal(path))

    class CourseContentsManager(AsyncLargeFileManager):
        """AsyncLargeFileManager with chapters/ read-only (see the module docstring)."""

        async def get(self, path, content=True, type=None, format=None, **kwargs):
            model = await super().get(path, content=content, type=type, format=format, **kwargs)
            if is_read_only(path):
                model["writable"] = False
            if model.get("type") == "directory" and isinstance(model.get("content"), list):
                for child in model["content"]:
                    if is_read_only(child.get("path", "")):
                        child["writable"] = False
            return model

        async def save(self, model, path=""):
            refuse(path)
            return await super().save(model, path)

        async def rename_file(self, old_path, new_path):
            refuse(old_path)
            refuse(new_path)
            return await super().rename_file(old_path, new_path)

        async def delete_file(self, path):
            refuse(path)
            return await super().delete_file(path)

    return CourseContentsManager


def configure(c, workspace: str | None = None, root: str = ".") -> None:
    """Apply the course's settings to a Jupyter config object `c`."""
    workspace = workspace or os.environ.get("AMPCOURSE_WORKSPACE") or "workspace"
    c.ServerApp.contents_manager_class = course_contents_manager()
    c.ContentsManager.pre_save_hook = pre_save
    c.LabApp.default_url = default_url(workspace, root)
    c.ServerApp.default_url = c.LabApp.default_url
    c.KernelSpecManager.allowed_kernelspecs = {KERNEL}
    # Kernels and terminals inherit the server's environment: the course's Python first (issue 28, item 13).
    os.environ["AMPCOURSE_BIN"] = environment_bin()
    os.environ["PATH"] = put_first_on_path(environment_bin(), os.environ.get("PATH"))
    command = terminal_command()
    if command:
        c.ServerApp.terminado_settings = {**dict(c.ServerApp.get("terminado_settings") or {}), "shell_command": command}
    c.LabApp.extra_labextensions_path = [str(LABEXTENSIONS)]
    # What the extension reads (page config "ampcourse"): which folders are read-only, where the workspace is.
    rel = os.path.relpath(os.path.join(os.path.abspath(root), workspace), os.path.abspath(root))
    settings = dict(c.ServerApp.get("tornado_settings") or {})
    settings["page_config_data"] = {**settings.get("page_config_data", {}), "ampcourse": {
        "readOnly": list(READ_ONLY_DIRS), "workspace": "" if rel.startswith("..") else PurePosixPath(*rel.split(os.sep)).as_posix(),
        "mark": TAB_MARK, "prefix": EDITED_PREFIX}}
    c.ServerApp.tornado_settings = settings


if "get_config" in globals():  # loaded by Jupyter as a config file (jupyter lab --config tools/lab_config.py)
    configure(get_config(), root=os.environ.get("AMPCOURSE_LAB_ROOT", "."))  # noqa: F821

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

Every rule is a plain function or class here, so tests use them without a server.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path, PurePosixPath
from urllib.parse import quote

READ_ONLY_DIRS = ("chapters",)  # relative to the server's root (the repository)
INDEX = "00_index.ipynb"
TOOLS = Path(__file__).resolve().parent  # Jupyter sets __file__ for a config file; Binder's exec passes it
sys.path.insert(0, str(TOOLS))
import nbtool  # noqa: E402  (the one home of the notebook rules: kernelspec, widget views)

WIDGET_VIEW = nbtool.WIDGET_VIEW
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


def course_contents_manager():
    """The server's contents manager with the read-only chapters (built lazily: jupyter_server imports here only)."""
    from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager
    from tornado import web

    def refuse(path: str) -> None:
        if is_read_only(path):
            raise web.HTTPError(403, f"{path} is read-only (the full chapters stay as git has them): work in your "
                                     "copy in workspace/, or File > Save As to keep a copy elsewhere")

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


if "get_config" in globals():  # loaded by Jupyter as a config file (jupyter lab --config tools/lab_config.py)
    configure(get_config(), root=os.environ.get("AMPCOURSE_LAB_ROOT", "."))  # noqa: F821

"""The one build step pyproject.toml cannot say: files the chapters read that live beside the package in a checkout
(ampcourse/shipped.py's SHIPPED: examples/ddp_amp.py, benchmarks/gpu/report.json) go into the wheel as
ampcourse/_shipped/<path>, so an installed course (Colab's `pip install --no-deps "git+..."`) still finds them.
Everything else is in pyproject.toml."""

import ast
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def shipped() -> tuple[str, ...]:
    """SHIPPED, read from ampcourse/shipped.py's source (importing ampcourse would need torch at build time)."""
    for node in ast.parse((HERE / "ampcourse" / "shipped.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SHIPPED" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise RuntimeError("ampcourse/shipped.py no longer defines SHIPPED")


class BuildPyWithShipped(build_py):
    """build_py, then a copy of each SHIPPED file that exists into build_lib/ampcourse/_shipped/."""

    def run(self):
        super().run()
        for name in shipped():
            src = HERE / name
            if src.is_file():
                dst = Path(self.build_lib) / "ampcourse" / "_shipped" / name
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)


setup(cmdclass={"build_py": BuildPyWithShipped})

"""Render Triton kernels from the Jinja2 templates in ``templates/``.

Templates are rendered with ``StrictUndefined``: a variable the caller forgot is an error at render
time, never an empty string in a kernel. ``render`` returns the kernel's source; ``cache.load_kernel``
writes it to the on-disk cache and imports it (Triton reads a kernel's source from its file).
"""
from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path

import jinja2


def template_dir():
    """Where the templates are: ``templates/`` of a source tree, else the installed ``loracc.templates``."""
    source_tree = Path(__file__).resolve().parents[2] / "templates"  # loracc/codegen/render.py → the tree
    if (source_tree / "lora_gemm.py.jinja").is_file():  # not any folder named templates beside the package
        return source_tree
    return importlib.resources.files("loracc.templates")


@functools.cache
def environment() -> jinja2.Environment:
    root = template_dir()
    loader = jinja2.FunctionLoader(lambda name: (root / name).read_text())
    return jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(template: str, **variables) -> str:
    """The source of ``template`` (a file name in ``templates/``) rendered with ``variables``."""
    try:
        return environment().get_template(template).render(**variables)
    except jinja2.UndefinedError as exc:
        raise TypeError(f"template {template}: {exc}; pass it to render()") from exc

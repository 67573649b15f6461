"""The API reference builds from the docstrings (``docs/build_api.py``, plain ``pydoc``), links every page from
its index, and every public name has a docstring to show there."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import tensorwire as tw

BUILDER = Path(__file__).resolve().parents[2] / "docs" / "build_api.py"


def _builder():
    spec = importlib.util.spec_from_file_location("build_api", BUILDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_builds_with_a_page_per_module(tmp_path):
    builder = _builder()
    pages = builder.build(tmp_path)
    index = (tmp_path / "index.html").read_text()
    assert all(f'href="{name}.html"' in index for name in builder.MODULES)
    assert {p.name for p in pages} == {"index.html", *(f"{name}.html" for name in builder.MODULES)}
    package = (tmp_path / "tensorwire.html").read_text()
    for name in ("init", "shared_empty", "Communicator", "TensorwireError", "all_to_all_v"):
        assert name in package, name
    communicator = (tmp_path / "tensorwire.communicator.html").read_text()
    assert "prepare_blocks" in communicator and "wait_notification" in communicator


def test_every_public_name_has_a_docstring():
    missing = [name for name in tw.__all__
               if (inspect.isclass(getattr(tw, name)) or inspect.isfunction(getattr(tw, name)))
               and not (getattr(tw, name).__doc__ or "").strip()]
    assert missing == [], f"public names without a docstring (the API reference shows nothing): {missing}"

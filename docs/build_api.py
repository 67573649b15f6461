"""Build tensorwire's API reference from its docstrings: one HTML page per public module, made by the standard
library's ``pydoc`` (nothing to install), and an index page. The pages link to one another by module name.

    python docs/build_api.py [OUT_DIR]        # default: docs/api (built, not committed)

``tests/unit/test_api_reference.py`` builds it in CI and checks that every public name has a docstring.
"""

from __future__ import annotations

import html
import importlib
import pydoc
import sys
from pathlib import Path

# The modules a user reaches: the package's re-exports and the modules that define them.
MODULES = (
    "tensorwire",
    "tensorwire.communicator",
    "tensorwire.registration",
    "tensorwire.transfer",
    "tensorwire.blocks",
    "tensorwire.descriptors",
    "tensorwire.errors",
    "tensorwire.shared_memory",
    "tensorwire.meeting.membership",
    "tensorwire.backends",
    "tensorwire.moe",
    "tensorwire.moe.dispatch",
    "tensorwire.moe.combine",
    "tensorwire.moe.alltoallv",
    "tensorwire.moe.engine",
    "tensorwire.testing",
    "tensorwire.testing.launch",
    "tensorwire.bench.record",
    "tensorwire.bench.timing",
)


def build(out: Path) -> list[Path]:
    """Write ``<module>.html`` for each of ``MODULES`` and ``index.html`` into ``out``; the pages written."""
    out.mkdir(parents=True, exist_ok=True)
    writer = pydoc.HTMLDoc()
    pages = []
    for name in MODULES:
        module = importlib.import_module(name)
        page = out / f"{name}.html"
        page.write_text(writer.page(pydoc.describe(module), writer.document(module, name)))
        pages.append(page)
    items = "".join(f'<li><a href="{name}.html">{name}</a>: {html.escape(_summary(name))}</li>' for name in MODULES)
    index = out / "index.html"
    index.write_text(writer.page("tensorwire API reference", f"<h1>tensorwire API reference</h1><ul>{items}</ul>"))
    return [index, *pages]


def _summary(name: str) -> str:
    doc = importlib.import_module(name).__doc__ or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "api"
    written = build(target)
    print(f"wrote {len(written)} pages to {target}")

"""What every test folder shares: a ``gpu`` test is skipped, with the reason, where torch sees no GPU.

The suite's helpers live in ``tensorwire.testing`` (``data``: values that encode their sender; ``suite``:
the bounded timeouts and ``launch``; ``scenarios`` and ``moe_reference``: what CPU and GPU tests share), so
test modules import them from there and never from each other.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    reason = (
        f"no CUDA device: torch.cuda.is_available() is False "
        f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    )
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

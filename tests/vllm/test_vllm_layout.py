"""What the connector asks of vLLM's cache layout, through vLLM's own choice of it: heads outermost in a block
(``HND``, vLLM's ``LBHNC``) for a head-split cache, nothing for MLA. vLLM's interpreter runs the check; the cache
it then allocates on GPUs is the permuted view tests/multiproc/test_vllm_worker.py registers (``cuda-hnd``)."""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.vllm

_CHECK = """
import json
from types import SimpleNamespace
from vllm.config import KVTransferConfig
from vllm.config.cache import _layout_from_name
from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

transfer = KVTransferConfig(kv_connector="TensorwireConnector",
                            kv_connector_module_path="tensorwire.integrations.vllm", kv_role="kv_both")
chosen = {}
for mla in (False, True):
    config = SimpleNamespace(kv_transfer_config=transfer, model_config=SimpleNamespace(use_mla=mla))
    layout = get_kv_connector_cache_layout(config)
    chosen["mla" if mla else "gqa"] = None if layout is None else [layout, _layout_from_name(layout).name]
print(json.dumps(chosen))
"""


def test_the_connector_asks_vllm_for_heads_outermost_except_for_mla(vllm_job):
    done = subprocess.run([vllm_job.python, "-c", _CHECK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = json.loads(done.stdout.strip().splitlines()[-1])
    assert chosen == {"gqa": ["HND", "LBHNC"], "mla": None}, chosen

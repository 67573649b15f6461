"""UCX's start-up options: set before NIXL loads, only where the user has not, never once NIXL is loaded, and off
with ``TENSORWIRE_UCX_DEFAULTS=0``. Each case runs in a fresh interpreter (which options UCX saw is per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json, os, sys
from tensorwire.backends import nixl_setup
if os.environ.get("PRETEND_NIXL_LOADED"):
    sys.modules.setdefault("nixl", type(sys)("nixl"))
nixl_setup._set_ucx_start_defaults()
nixl_setup._set_ucx_start_defaults()  # as every later import_nixl: changes nothing
print(json.dumps({"env": {k: os.environ.get(k) for k in nixl_setup.UCX_START_DEFAULTS},
                  "rows": nixl_setup.ucx_start_options()}))
"""


def _run(env_changes: dict[str, str | None]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in env_changes and not k.startswith("UCX_")}
    env.update({k: v for k, v in env_changes.items() if v is not None})
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_unset_options_get_the_defaults():
    from tensorwire.backends.nixl_setup import UCX_START_DEFAULTS

    got = _run({"TENSORWIRE_UCX_DEFAULTS": None})
    assert got["env"] == UCX_START_DEFAULTS
    assert {who for _, _, who in got["rows"]} == {"tensorwire"}


def test_the_users_value_wins():
    from tensorwire.backends.nixl_setup import UCX_START_DEFAULTS

    name = next(iter(UCX_START_DEFAULTS))
    got = _run({name: "y", "TENSORWIRE_UCX_DEFAULTS": None})
    assert got["env"][name] == "y"
    assert [who for n, _, who in got["rows"] if n == name] == ["user"]


@pytest.mark.parametrize("value", ["0", "off"])
def test_turned_off_sets_nothing(value):
    got = _run({"TENSORWIRE_UCX_DEFAULTS": value})
    assert set(got["env"].values()) == {None}
    assert {who for _, _, who in got["rows"]} == {"unset"}


def test_nothing_is_set_once_nixl_is_loaded():
    got = _run({"TENSORWIRE_UCX_DEFAULTS": None, "PRETEND_NIXL_LOADED": "1"})
    assert set(got["env"].values()) == {None}
    assert {who for _, _, who in got["rows"]} == {"unset: NIXL loaded before tensorwire"}

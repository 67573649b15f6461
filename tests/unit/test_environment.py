"""Where a rank learns its place (each launcher's variables, keywords over them) and the ``TENSORWIRE_*``
configuration: values read, bad ones refused with the variable named."""

from __future__ import annotations

import os

import pytest

import tensorwire as tw
from tensorwire import config, environment

# --- environment ----------------------------------------------------------------------------------
_LAUNCHER_VARS = [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
    "TENSORWIRE_TIMEOUT", "TENSORWIRE_PROGRESS_WAKEUP_MS", "TENSORWIRE_SPIN_US", "TENSORWIRE_MAX_SLEEP_US",
]


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher or TENSORWIRE_* variables from the host leak into a test."""
    for name in _LAUNCHER_VARS + [name for name in os.environ if name.startswith("TENSORWIRE_")]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _env(rank, world, local_rank, local_world, addr, port, launcher):
    return environment.Environment(rank, world, local_rank, local_world, addr, port, launcher)


@pytest.mark.parametrize("variables, expected", [
    (dict(RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"),
     _env(3, 8, 1, 2, "10.0.0.1", 29500, "torchrun")),
    (dict(OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="6", OMPI_COMM_WORLD_LOCAL_RANK="2",
          OMPI_COMM_WORLD_LOCAL_SIZE="3", MASTER_ADDR="node0", MASTER_PORT="1234"),
     _env(5, 6, 2, 3, "node0", 1234, "mpirun")),
    # SLURM's '4(x2)' tasks-per-node syntax
    (dict(SLURM_PROCID="7", SLURM_NTASKS="8", SLURM_LOCALID="3", SLURM_NTASKS_PER_NODE="4(x2)",
          MASTER_ADDR="head", MASTER_PORT="4000"),
     _env(7, 8, 3, 4, "head", 4000, "slurm")),
], ids=["torchrun", "openmpi", "slurm"])
def test_environment_of_each_launcher(clean_env, variables, expected):
    """torchrun's RANK/..., mpirun's OMPI_COMM_WORLD_* and SLURM_* variables are read."""
    for k, v in variables.items():
        clean_env.setenv(k, v)
    assert environment.resolve_environment() == expected


def test_environment_torchrun_wins_over_openmpi(clean_env):
    """When several launchers' variables are set, torchrun's are used."""
    for k, v in dict(RANK="1", WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="4",
                     MASTER_ADDR="a", MASTER_PORT="1").items():
        clean_env.setenv(k, v)
    env = environment.resolve_environment()
    assert (env.rank, env.world_size, env.launcher) == (1, 2, "torchrun")


def test_environment_local_rank_defaults(clean_env):
    """Without LOCAL_RANK/LOCAL_WORLD_SIZE the local values fall back to the global ones."""
    for k, v in dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="a", MASTER_PORT="1").items():
        clean_env.setenv(k, v)
    env = environment.resolve_environment()
    assert (env.local_rank, env.local_world_size) == (1, 2)


def test_environment_default_is_single_rank(clean_env):
    """No launcher variables: a 1-rank world that needs no MASTER_ADDR."""
    env = environment.resolve_environment()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (0, 1, 0, 1, "none")


def test_environment_keywords_override(clean_env):
    """rank=, world_size=, master_addr=, master_port= override the environment."""
    for k, v in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="a", MASTER_PORT="1").items():
        clean_env.setenv(k, v)
    env = environment.resolve_environment(rank=3, world_size=4, master_addr="b", master_port=77)
    assert (env.rank, env.world_size, env.master_addr, env.master_port) == (3, 4, "b", 77)


def test_environment_missing_master_addr(clean_env):
    """A world of several ranks without MASTER_ADDR is an InvalidArgumentError that names MASTER_ADDR."""
    for k, v in dict(RANK="0", WORLD_SIZE="2", MASTER_PORT="29500").items():
        clean_env.setenv(k, v)
    with pytest.raises(tw.InvalidArgumentError, match="MASTER_ADDR"):
        environment.resolve_environment()


def test_environment_missing_master_port(clean_env):
    """A world of several ranks without MASTER_PORT is an InvalidArgumentError that names MASTER_PORT."""
    for k, v in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="x").items():
        clean_env.setenv(k, v)
    with pytest.raises(tw.InvalidArgumentError, match="MASTER_PORT"):
        environment.resolve_environment()


@pytest.mark.parametrize(
    "variables,text",
    [
        (dict(RANK="2", WORLD_SIZE="2"), "rank=2 is outside [0, 2)"),
        (dict(RANK="x", WORLD_SIZE="2"), "RANK='x' is not an integer"),
        (dict(RANK="0", WORLD_SIZE="0"), "world_size=0"),
        (dict(RANK="0", WORLD_SIZE="2", MASTER_PORT="http"), "MASTER_PORT='http' is not an integer"),
    ],
)
def test_environment_bad_values(clean_env, variables, text):
    """Out-of-range or non-integer launcher variables raise InvalidArgumentError naming the variable."""
    clean_env.setenv("MASTER_ADDR", "a")
    clean_env.setenv("MASTER_PORT", "1")
    for k, v in variables.items():
        clean_env.setenv(k, v)
    with pytest.raises(tw.InvalidArgumentError) as info:
        environment.resolve_environment()
    assert text in str(info.value)


def test_init_rejects_non_positive_timeout(clean_env):
    """tw.init(timeout=0) raises InvalidArgumentError before touching the network."""
    with pytest.raises(tw.InvalidArgumentError, match="positive"):
        tw.init(timeout=0)


def test_init_rejects_bad_config_env(clean_env):
    """tw.init with an unparsable TENSORWIRE_TIMEOUT raises InvalidArgumentError naming the variable."""
    clean_env.setenv("TENSORWIRE_TIMEOUT", "soon")
    with pytest.raises(tw.InvalidArgumentError, match="TENSORWIRE_TIMEOUT"):
        tw.init()


# --- config ---------------------------------------------------------------------------------------
def test_config_defaults(clean_env):
    """Without TENSORWIRE_* variables the documented defaults apply."""
    assert config.load() == config.Config(timeout_s=300.0, progress_wakeup_ms=10.0, spin_us=50.0, max_sleep_us=1000.0)


def test_config_reads_environment(clean_env):
    """TENSORWIRE_* variables are parsed as numbers; an empty value means the default."""
    clean_env.setenv("TENSORWIRE_TIMEOUT", "12.5")
    clean_env.setenv("TENSORWIRE_PROGRESS_WAKEUP_MS", "3")
    clean_env.setenv("TENSORWIRE_SPIN_US", "0")
    clean_env.setenv("TENSORWIRE_MAX_SLEEP_US", "")
    assert config.load() == config.Config(timeout_s=12.5, progress_wakeup_ms=3.0, spin_us=0.0, max_sleep_us=1000.0)


@pytest.mark.parametrize("name", ["TENSORWIRE_TIMEOUT", "TENSORWIRE_PROGRESS_WAKEUP_MS", "TENSORWIRE_SPIN_US",
                                  "TENSORWIRE_MAX_SLEEP_US"])
@pytest.mark.parametrize("value,text", [("abc", "is not a number"), ("-1", "is negative")])
def test_config_bad_value(clean_env, name, value, text):
    """A non-numeric or negative TENSORWIRE_* value raises InvalidArgumentError naming the variable."""
    clean_env.setenv(name, value)
    with pytest.raises(tw.InvalidArgumentError) as info:
        config.load()
    assert name in str(info.value) and text in str(info.value)



@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_init_refuses_a_timeout_that_could_not_end(value):
    """A NaN or infinite timeout would make every wait unbounded: refused before anything starts."""
    with pytest.raises(tw.InvalidArgumentError, match="timeout="):
        tw.init(timeout=value)


def test_config_refuses_a_non_finite_timeout(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_TIMEOUT", "nan")
    with pytest.raises(tw.InvalidArgumentError, match="TENSORWIRE_TIMEOUT='nan' is not finite"):
        config.load()


@pytest.mark.parametrize("directory", [
    "etcd:/bob:hunter2@etcd-0:2379",  # a scheme mistyped
    "etcd-0:2379?password=hunter2",  # no scheme, a query
    "bob:hunter2@etcd-0:2379",
    "etcd://etcd-0:2379?password=hunter2",
    "tcp://etcd-0:99999#hunter2",
])
def test_a_malformed_directory_url_is_refused_without_its_password(directory):
    with pytest.raises(tw.InvalidArgumentError) as refused:
        environment.parse_directory(directory)
    assert "hunter2" not in str(refused.value) and "etcd" in str(refused.value)

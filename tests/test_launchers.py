"""Launcher options: what a Slurm pool asks of Slurm, where it listens, and the errors for
options that cannot work (no cluster needed: each is refused before anything starts)."""
import argparse
import shlex

import pytest

from elastic_jupyter.config import UsageError
from elastic_jupyter.pool.launchers import SLURM_TEMPLATE, SlurmLauncher, make_launcher
from elastic_jupyter.ui.magics import _launcher, _pool_parser
from elastic_jupyter.pool.engine_sets import check_versions as _check_versions


def options(line: str) -> argparse.Namespace:
    return _pool_parser().parse_args(["start", *shlex.split(line)])


def test_an_engine_job_asks_slurm_for_what_the_options_say():
    launcher = SlurmLauncher(partition="gpu", account="lab", time="1-00:00:00",
                             gpus_per_engine=1, cpus_per_engine=8, grace=120,
                             interface="lo", options=("--qos=debug",))
    assert launcher.batch_options() == [
        "#SBATCH --cpus-per-task=8", "#SBATCH --signal=TERM@120", "#SBATCH --partition=gpu",
        "#SBATCH --account=lab", "#SBATCH --time=1-00:00:00", "#SBATCH --gpus-per-task=1",
        "#SBATCH --qos=debug"]
    config = launcher.cluster_options("/private/pool")["config"].SlurmEngineSetLauncher
    assert config.batch_file_name == "/private/pool/slurm_engine.sbatch"  # not the notebook's
    script = config.batch_template
    assert "#SBATCH --qos=debug\n" in script
    assert "trap : TERM\nsrun --cpus-per-task=8 {program_and_args}" in script
    assert launcher.engine_env() == {"ELASTIC_JUPYTER_OWNER_ADDRESS": "127.0.0.1"}
    # CPU engines see no GPU; braces in an option are not template fields
    cpu = SlurmLauncher(interface="lo", options=("--comment={a}",))
    assert cpu.engine_env()["CUDA_VISIBLE_DEVICES"] == ""
    assert "--comment={{a}}" in cpu.cluster_options("/p")["config"].SlurmEngineSetLauncher \
        .batch_template
    assert "{options}" in SLURM_TEMPLATE


@pytest.mark.parametrize("interface, fragment", [
    ("0.0.0.0", "never listens on all of them"),
    ("all", "never listens on all of them"),
    ("nosuch0", "--interface nosuch0: no such interface"),
])
def test_the_pool_never_listens_on_every_interface_or_an_unknown_one(interface, fragment):
    with pytest.raises(UsageError, match=fragment):
        SlurmLauncher(interface=interface)


def test_the_default_address_is_on_the_route_to_slurmctld(monkeypatch):
    monkeypatch.setattr("elastic_jupyter.pool.launchers.slurm._slurmctld_host",
                        lambda: "127.0.0.1")
    assert SlurmLauncher().address == "127.0.0.1"
    assert SlurmLauncher(interface="127.0.0.1").address == "127.0.0.1"  # an address works too


def test_bad_launcher_options_are_refused_with_what_to_do(monkeypatch):
    with pytest.raises(UsageError, match="--launcher takes local, ssh or slurm, got 'pbs'"):
        make_launcher("pbs")
    with pytest.raises(UsageError, match="--gpus-per-engine must be an integer >= 0"):
        SlurmLauncher(gpus_per_engine=-1, interface="lo")
    with pytest.raises(UsageError, match="--launcher local takes none of --partition, --time"):
        _launcher(options("--partition gpu --time 30"))
    with pytest.raises(UsageError, match="--launcher ssh takes none of --grace"):
        _launcher(options("--launcher ssh --hosts a:1 --grace 5"))
    with pytest.raises(UsageError, match="--hosts takes host:slots pairs like gpu1:4,gpu2:4"):
        _launcher(options("--launcher ssh --hosts a:x"))
    with pytest.raises(UsageError, match="--hosts takes"):
        _launcher(options("--launcher ssh"))
    ssh = _launcher(options("--launcher ssh --hosts me@127.0.0.1:2,127.0.0.2"))
    assert ssh.slots == [("me@127.0.0.1", 0), ("me@127.0.0.1", 1), ("127.0.0.2", 0)]
    assert ssh.host_of(1) == "127.0.0.1" and ssh.address == "127.0.0.1"
    assert ssh.start_options(2) == {"engines": {"127.0.0.2": 1},
                                    "environment": {"CUDA_VISIBLE_DEVICES": ""}}
    assert _launcher(options("-n 2")) is None  # this host's launcher
    launcher = _launcher(options("--launcher slurm --partition gpu --interface lo"))
    assert launcher.partition == "gpu" and launcher.address == "127.0.0.1"
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UsageError, match="needs Slurm's sbatch on PATH"):
        SlurmLauncher(interface="lo")


def test_an_engine_of_other_versions_is_refused_naming_the_difference():
    from elastic_jupyter.engine.entrypoints import versions
    mine = versions()
    _check_versions([{"host": "gpu1", "versions": mine}])
    other = dict(mine, torch="2.0.0")
    with pytest.raises(RuntimeError) as refused:
        _check_versions([{"host": "gpu1", "versions": mine}, {"host": "gpu2", "versions": other}])
    assert str(refused.value).startswith(
        f"the engine on gpu2 runs torch 2.0.0 (this kernel: {mine['torch']}): install the same")

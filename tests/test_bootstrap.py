"""`collectives.init()`: which backend a launch means, the one-rank fallback, node emulation."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

import collectives
from collectives import bootstrap
from collectives.backends.threads import ThreadFabric

_EVALUATOR = '{"cluster": {"chief": ["a:1"], "worker": ["b:2"], "evaluator": ["c:3"]}, "task": {"type": "evaluator"}}'


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpi"),  # MPICH / hydra
        ({"OMPI_COMM_WORLD_RANK": "1"}, "mpi"),  # Open MPI
        ({"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:2"]}}'}, "grpc"),
        ({"TF_CONFIG": "not json"}, "grpc"),  # init() then says what is wrong with it
        ({"TF_CONFIG": ""}, None),  # TensorFlow's single process
        ({"TF_CONFIG": "{}"}, None),
        ({"TF_CONFIG": '{"task": {"type": "worker", "index": 0}}'}, None),
        ({"TF_CONFIG": _EVALUATOR}, None),  # it evaluates alone, as in tf.distribute
        ({"COLLECTIVES_ADDRESSES": "127.0.0.1:1"}, "grpc"),
        ({"COLLECTIVES_RANK": "1", "COLLECTIVES_WORLD_SIZE": "2"}, "grpc"),  # not a world of one
        ({"COLLECTIVES_ADDRESSES": "127.0.0.1:1", "PMI_RANK": "0"}, "grpc"),  # the launcher under srun
        ({"COLLECTIVES_BACKEND": "mpi", "TF_CONFIG": "{}"}, "mpi"),  # the explicit choice wins
    ],
)
def test_detect_backend(environ: dict[str, str], expected: str | None) -> None:
    """An MPI launch, a TF_CONFIG describing a cluster or any of the launcher's variables each
    select their backend."""
    assert bootstrap.detect_backend(environ) == expected


def test_a_rank_and_size_without_addresses_fail_saying_what_is_missing(monkeypatch) -> None:
    """They made a world of one that trained alone, with no error."""
    for name in ("COLLECTIVES_BACKEND", "COLLECTIVES_ADDRESSES", "TF_CONFIG", "PMI_RANK", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLLECTIVES_RANK", "1")
    monkeypatch.setenv("COLLECTIVES_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="COLLECTIVES_ADDRESSES"):
        collectives.init(timeout=5)


def test_an_evaluator_task_runs_alone_and_the_log_says_why(monkeypatch, caplog) -> None:
    """init() raised on the evaluator task of a TF_CONFIG job ("takes no part in collectives")."""
    for name in ("COLLECTIVES_BACKEND", "COLLECTIVES_ADDRESSES", "COLLECTIVES_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TF_CONFIG", _EVALUATOR)
    monkeypatch.setattr(bootstrap, "_default", None)
    with caplog.at_level(logging.INFO, logger="collectives.bootstrap"):
        comm = collectives.init(autotune="off")
    assert (comm.rank, comm.size) == (0, 1)
    np.testing.assert_array_equal(comm.allreduce(np.arange(3.0), op="mean"), [0.0, 1.0, 2.0])
    assert "names this task the evaluator" in caplog.text


def test_init_called_again_alike_returns_the_open_communicator_as_hvd_init_does(monkeypatch) -> None:
    """A second init() with the same arguments and launch, as a library and its script may both
    make, is the first one's communicator: on gRPC it failed ("cannot listen" on the rank's own
    address, or under the launcher "rank 0 already has its stream here"). Other arguments while
    the first is open are refused, saying what to do; once it is closed init() makes a new one."""
    from collectives.launch import free_loopback_ports

    for name in ("COLLECTIVES_BACKEND", "TF_CONFIG", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLLECTIVES_RANK", "0")
    monkeypatch.setenv("COLLECTIVES_WORLD_SIZE", "1")
    monkeypatch.setenv("COLLECTIVES_ADDRESSES", f"127.0.0.1:{free_loopback_ports(1)[0]}")
    monkeypatch.setenv("COLLECTIVES_SECRET", "s" * 32)
    monkeypatch.setattr(bootstrap, "_default", None)
    first = collectives.init(timeout=10, autotune="off")
    try:
        assert collectives.init(timeout=10, autotune="off") is first
        with pytest.raises(RuntimeError, match="already called in this process, with other arguments"):
            collectives.init(timeout=20, autotune="off")
        assert not first.closed
    finally:
        first.close()
    second = collectives.init(timeout=10, autotune="off")
    assert second is not first
    second.close()


def test_init_again_in_a_ps_job_says_its_world_stays_open(monkeypatch) -> None:
    """In a TF_CONFIG job with ps tasks, close() closes the workers' communicator, while the world
    under it (listening on this rank's address) lasts until exit: init() again failed with a raw
    "cannot listen ... Address already in use"."""
    for name in ("COLLECTIVES_BACKEND", "TF_CONFIG", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLLECTIVES_RANK", "0")
    monkeypatch.setenv("COLLECTIVES_WORLD_SIZE", "1")
    world = collectives.Communicator(ThreadFabric(["node"]).endpoint(0))
    workers = collectives.Communicator(ThreadFabric(["node"]).endpoint(0))
    workers.close()
    monkeypatch.setattr(bootstrap, "_default", workers)
    monkeypatch.setattr(bootstrap, "_listening", world)
    try:
        with pytest.raises(RuntimeError, match="job with ps tasks, whose world .* stays open until the process exits"):
            collectives.init(timeout=10, autotune="off")
    finally:
        world.close()


def test_init_makes_a_new_world_when_the_launch_changed(monkeypatch) -> None:
    """Threads (one rank) again alike: the same; another node layout: a new one."""
    monkeypatch.delenv("COLLECTIVES_RANKS_PER_NODE", raising=False)
    monkeypatch.setattr(bootstrap, "_default", None)
    first = collectives.init("threads", autotune="off")
    try:
        assert collectives.init("threads", autotune="off") is first
        monkeypatch.setenv("COLLECTIVES_RANKS_PER_NODE", "1")
        other = collectives.init("threads", autotune="off")
        assert other is not first and collectives.default_communicator() is other
        other.close()
    finally:
        first.close()


@pytest.mark.parametrize("variable", ["COLLECTIVES_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"])
def test_a_backend_that_makes_a_smaller_world_than_the_launch_is_refused(monkeypatch, variable: str) -> None:
    """init(backend=...) other than the launch's (threads under mpiexec, MPI under the launcher)
    gave every process a world of one: each trained alone, its all-reduce returning its own data."""
    for name in ("COLLECTIVES_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "2")
    refusal = re.escape(f"the launch started 2 ranks ({variable}=2), but init(backend='threads') made a world of 1")
    with pytest.raises(RuntimeError, match=refusal):
        collectives.init("threads", autotune="off")
    bootstrap._check_launched_size("grpc", 2, {variable: "2"})
    if variable != "COLLECTIVES_WORLD_SIZE":  # the launcher's gRPC ranks inherit PMI variables under srun
        bootstrap._check_launched_size("grpc", 4, {variable: "2"})
    monkeypatch.setenv(variable, "1")
    collectives.init("threads", autotune="off").close()


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="COLLECTIVES_BACKEND='tcp' is not a backend"):
        bootstrap.detect_backend({"COLLECTIVES_BACKEND": "tcp"})
    with pytest.raises(ValueError, match="unknown backend 'tcp'"):
        collectives.init("tcp")


@pytest.mark.parametrize(
    ("argument", "environ", "expected"),
    [
        (None, {}, "calibrate"),
        (None, {"COLLECTIVES_AUTOTUNE": ""}, "calibrate"),
        (None, {"COLLECTIVES_AUTOTUNE": "tune"}, "tune"),
        ("off", {"COLLECTIVES_AUTOTUNE": "tune"}, "off"),  # the argument wins
        (False, {"COLLECTIVES_AUTOTUNE": "tune"}, "off"),  # as Communicator(autotune=False)
        (True, {}, "tune"),
        (None, {"COLLECTIVES_AUTOTUNE": "1"}, "tune"),  # as HOROVOD_AUTOTUNE=1
        (None, {"COLLECTIVES_AUTOTUNE": "True"}, "tune"),
        (None, {"COLLECTIVES_AUTOTUNE": "no"}, "off"),
        (None, {"COLLECTIVES_AUTOTUNE": "OFF"}, "off"),
    ],
)
def test_autotune_mode(argument: bool | str | None, environ: dict[str, str], expected: str) -> None:
    """init() calibrates unless told otherwise, by its argument or COLLECTIVES_AUTOTUNE."""
    assert bootstrap._autotune_mode(argument, environ) == expected


def test_communicators_take_the_names_init_takes() -> None:
    """`run_threads`/`Communicator` and `init()` take the same autotune names and booleans."""

    def tuned(comm: collectives.Communicator) -> bool:
        return comm.explain(4096).tuned

    assert collectives.run_threads(tuned, 2, autotune="off") == [False, False]
    assert collectives.run_threads(tuned, 2, autotune="calibrate") == [True, True]
    with pytest.raises(ValueError, match="autotune='fast' is not an autotune mode"):
        collectives.run_threads(tuned, 2, autotune="fast")


def test_unknown_autotune_mode_is_refused_before_anything_starts(monkeypatch) -> None:
    with pytest.raises(ValueError, match="autotune='fast' is not an autotune mode"):
        collectives.init("threads", autotune="fast")
    monkeypatch.setenv("COLLECTIVES_AUTOTUNE", "always")
    with pytest.raises(ValueError, match="COLLECTIVES_AUTOTUNE='always' is not an autotune mode"):
        collectives.init("threads")


def test_init_without_a_launcher_is_one_rank_and_says_so(monkeypatch, caplog) -> None:
    """Nothing detected: a working size-1 communicator, announced once at info level, that
    becomes the default communicator."""
    for name in (
        "PMI_RANK",
        "PMI_SIZE",
        "PMIX_RANK",
        "OMPI_COMM_WORLD_RANK",
        "MPI_LOCALRANKID",
        "TF_CONFIG",
        "COLLECTIVES_ADDRESSES",
        "COLLECTIVES_BACKEND",
        "COLLECTIVES_RANKS_PER_NODE",
    ):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.INFO, logger="collectives.bootstrap"):
        comm = collectives.init()
    try:
        assert (comm.rank, comm.size) == (0, 1)
        assert "running as a single rank" in caplog.text
        assert collectives.default_communicator() is comm
        np.testing.assert_array_equal(comm.allreduce(np.arange(3.0)), np.arange(3.0))
    finally:
        comm.close()


def test_ranks_per_node_sets_the_host(monkeypatch) -> None:
    monkeypatch.setenv("COLLECTIVES_RANKS_PER_NODE", "2")
    comm = collectives.init("threads")
    try:
        assert comm.topology.hosts == ("node0",)
    finally:
        comm.close()


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bad_ranks_per_node_is_refused(monkeypatch, value: str) -> None:
    monkeypatch.setenv("COLLECTIVES_RANKS_PER_NODE", value)
    with pytest.raises(ValueError, match="COLLECTIVES_RANKS_PER_NODE must be a positive integer"):
        collectives.init("threads")


def test_default_communicator_before_init(monkeypatch) -> None:
    monkeypatch.setattr(bootstrap, "_default", None)
    with pytest.raises(RuntimeError, match=r"collectives.init\(\) has not been called"):
        collectives.default_communicator()

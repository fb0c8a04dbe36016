"""`python -m collectives.launch -n 4 [--backend grpc|mpi] [--ranks-per-node 2] [-m] script.py args...`

Starts the ranks of a job on this machine, like `horovodrun` or `torchrun`:

* gRPC (default): one process per rank, each given its rank, the world size, every rank's loopback
  address (free ports) and a fresh shared secret through the environment, so `collectives.init()`
  finds them. The launcher holds each port until its rank listens on it, so that no other user
  can take it in between (`reserve_loopback_ports`);
* MPI: hands the job to the `mpiexec` installed with the `mpi` extra.

Every line a rank prints is prefixed with "[rank]". If a rank exits non-zero, the others are
stopped (SIGTERM, then SIGKILL), the failing rank's last lines are shown again, and the launcher
exits with that rank's code. Only processes this launcher started are ever signalled.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO

from collectives.backends._grpc_config import ENV_REUSE_PORT
from collectives.backends.base import ENV_RANKS_PER_NODE
from collectives.bootstrap import ENV_ADDRESSES, ENV_BACKEND, ENV_RANK, ENV_SECRET, ENV_WORLD_SIZE

_LAST_LINES = 20
_STOP_GRACE_SECONDS = 5.0


def free_loopback_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 right now."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def reserve_loopback_ports(count: int) -> list[socket.socket]:
    """`count` sockets bound to distinct free ports of 127.0.0.1 with SO_REUSEPORT, not listening.

    While one is open nobody else can bind its port: Linux shares a SO_REUSEPORT port only between
    sockets of the same user that all set the option. The rank, told so by COLLECTIVES_REUSE_PORT=1,
    binds it with SO_REUSEPORT as well; `_held_until_listening` closes each once its rank listens.
    (Picking free ports and closing them, as before, let another user's program bind a port first
    and be taken for the rank.)
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(("127.0.0.1", 0))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _listening_loopback_ports() -> set[int] | None:
    """The TCP ports something listens on (from /proc/net/tcp and tcp6), or None where unknown."""
    rows: list[list[str]] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                rows += [line.split() for line in lines.read().splitlines()[1:]]
        except OSError:
            return None
    listening = "0A"
    return {int(row[1].rsplit(":", 1)[1], 16) for row in rows if row[3] == listening}


@contextlib.contextmanager
def _held_until_listening(reservations: Sequence[socket.socket], poll_seconds: float = 0.05) -> Iterator[None]:
    """Keep each reserved port until a socket listens on it (its rank's server), then let it go;
    all are let go when the block ends. Where listening ports cannot be seen, they go at once."""
    held = {sock.getsockname()[1]: sock for sock in reservations}
    done = threading.Event()

    def release() -> None:
        while held and not done.wait(poll_seconds):
            listening = _listening_loopback_ports()
            for port in list(held):
                if listening is None or port in listening:
                    held.pop(port).close()

    watcher = threading.Thread(target=release, name="collectives-port-reservations", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        for sock in held.values():
            sock.close()


class _Rank:
    """One started process and the tail of its output."""

    def __init__(self, label: str, command: Sequence[str], env: dict[str, str], lock: threading.Lock):
        self.label = label
        self.last_lines: collections.deque[str] = collections.deque(maxlen=_LAST_LINES)
        self.process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, so we can stop it and its children
        )
        self._reader = threading.Thread(target=self._forward, args=(self.process.stdout, lock), daemon=True)
        self._reader.start()

    def _forward(self, stream: IO[bytes], lock: threading.Lock) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.last_lines.append(line)
            with lock:
                print(f"{self.label}{line}", flush=True)

    def stop(self, sig: int) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                pass

    def join_output(self) -> None:
        self._reader.join(timeout=_STOP_GRACE_SECONDS)


class _Terminated(Exception):
    """The launcher itself was asked to stop (SIGTERM, SIGHUP), e.g. by a batch system."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, _frame: object) -> None:
    raise _Terminated(signum)


def run_ranks(jobs: Sequence[tuple[str, Sequence[str], Mapping[str, str]]], timeout: float | None = None) -> int:
    """Start every (label, command, environment) job, forward its output prefixed with `label`,
    and wait for all; on the first failure, after `timeout` seconds, on Ctrl-C, SIGTERM or SIGHUP,
    or on any exception, stop every job still running. Returns the exit code. Call it from the
    main thread (it sets signal handlers while it waits).

    Other tools that place ranks themselves (in network namespaces, say) reuse this supervision.
    """
    lock = threading.Lock()
    ranks: list[_Rank] = []
    try:
        for label, command, env in jobs:
            ranks.append(_Rank(label, command, dict(env), lock))
        return _supervise(ranks, timeout)
    except BaseException:
        _stop_all(ranks)
        raise


def _supervise(ranks: list[_Rank], timeout: float | None = None) -> int:
    """Wait for every rank; on the first failure, at `timeout`, on an interrupt or a termination
    signal stop the rest. Returns the exit code."""
    deadline = None if timeout is None else time.monotonic() + timeout
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            codes = [rank.process.poll() for rank in ranks]  # poll all: collects every exit
            failed = next((r for r, code in zip(ranks, codes) if code not in (None, 0)), None)
            if failed is not None or None not in codes:
                break
            if deadline is not None and time.monotonic() > deadline:
                _stop_all(ranks)
                print(
                    f"collectives.launch: the job did not finish within {timeout:g} s; stopped every rank",
                    file=sys.stderr,
                )
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop_all(ranks)
        return 130
    except _Terminated as stop:
        _stop_all(ranks)
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failed is None:
        for rank in ranks:
            rank.join_output()
        return 0
    _stop_all(ranks)
    code = failed.process.returncode
    reason = f"signal {-code}" if code < 0 else f"code {code}"
    print(
        f"collectives.launch: {failed.label.strip() or 'the job'} exited with {reason}; "
        f"stopped the other ranks. Its last lines:",
        file=sys.stderr,
    )
    for line in failed.last_lines:
        print(f"    {line}", file=sys.stderr)
    return code if code > 0 else 128 - code


def _stop_all(ranks: list[_Rank]) -> None:
    for rank in ranks:
        rank.stop(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_SECONDS
    for rank in ranks:
        try:
            rank.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank.stop(signal.SIGKILL)
            rank.process.wait()
        rank.join_output()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m collectives.launch",
        description="Start the ranks of a collectives job on this machine.",
    )
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    parser.add_argument("--backend", choices=("grpc", "mpi"), default="grpc")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="emulate nodes of this many ranks (for hierarchical algorithms)",
    )
    parser.add_argument("-m", "--module", action="store_true", help="run the script argument as a module (python -m)")
    parser.add_argument("script", help="the Python script (or, with -m, module) every rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nprocs < 1:
        print("collectives.launch: -n must be at least 1", file=sys.stderr)
        return 2
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        print("collectives.launch: --ranks-per-node must be at least 1", file=sys.stderr)
        return 2
    command = [sys.executable, *(["-m"] if args.module else []), args.script, *args.args]
    if args.backend == "mpi":
        mpiexec = _find_mpiexec()
        if mpiexec is None:
            print(
                "collectives.launch: mpiexec not found; install the MPI extra: pip install -e '.[mpi]'",
                file=sys.stderr,
            )
            return 2
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{ENV_BACKEND: "mpi"})
        if args.ranks_per_node is not None:
            env[ENV_RANKS_PER_NODE] = str(args.ranks_per_node)
        return run_ranks([("", [mpiexec, "-prepend-rank", "-n", str(args.nprocs), *command], env)])
    reservations = reserve_loopback_ports(args.nprocs)
    addresses = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in reservations]
    environments = grpc_rank_environments(addresses, ranks_per_node=args.ranks_per_node)
    for env in environments:
        env[ENV_REUSE_PORT] = "1"
    with _held_until_listening(reservations):
        return run_ranks([(f"[{rank}] ", command, env) for rank, env in enumerate(environments)])


def grpc_rank_environments(
    addresses: Sequence[str], *, ranks_per_node: int | None = None, base: Mapping[str, str] | None = None
) -> list[dict[str, str]]:
    """The environment of each gRPC rank of a job whose rank r listens on `addresses[r]`.

    `base` (default: this process's environment) plus what `collectives.init()` reads: the backend,
    the rank, the world size, every address and one fresh shared secret for the whole job, and the
    emulated node size if given. Unbuffered output, so that prefixed lines arrive as printed.
    """
    shared = dict(os.environ if base is None else base)
    shared.update(
        {
            "PYTHONUNBUFFERED": "1",
            ENV_BACKEND: "grpc",
            ENV_WORLD_SIZE: str(len(addresses)),
            ENV_ADDRESSES: ",".join(addresses),
            ENV_SECRET: secrets.token_hex(16),
        }
    )
    if ranks_per_node is not None:
        shared[ENV_RANKS_PER_NODE] = str(ranks_per_node)
    return [{**shared, ENV_RANK: str(rank)} for rank in range(len(addresses))]


def _find_mpiexec() -> str | None:
    """The mpiexec next to this Python (the `mpich` wheel's), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


if __name__ == "__main__":
    sys.exit(main())

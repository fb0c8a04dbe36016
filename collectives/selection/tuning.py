"""The measured tuning pass behind `Communicator.tune()`, and its cache file.

The cost model gets the shape of each algorithm's cost right but not everything a real backend
adds (Python overhead per message, thread wake-ups, cache effects). So at a few sizes the pass
times every candidate for real and keeps measured / predicted for each (`Tuning`), which the
selector multiplies its predictions by: at those sizes auto then picks what was measured fastest.
Every candidate is timed, not only the model's favourites, because the model can be wrong by more
than the gaps between its candidates (on one machine's threads it overrates the tree 2x). Calls
are interleaved round by round across the candidates, so a burst of machine noise hits all of
them alike. Times are the slowest rank's, median of the rounds, and pass through an all-reduce, so
every rank keeps identical numbers.

The probed link costs and the ratios are saved as JSON under a name made from the topology's
fingerprint (backend, node layout, segment size, library version). Rank 0 reads the file and
broadcasts it, so a second run with the same layout starts tuned without measuring, and ranks on
different machines cannot end up with different files' contents. Rank 0 alone writes it, through a
scratch file renamed into place, so a reader never sees half a file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from collectives._version import __version__
from collectives.core.topology import LinkCost, LinkCosts, Topology
from collectives.selection.selector import Selector, Tuning

if TYPE_CHECKING:
    from collectives.communicator import Communicator

TUNE_SIZES = (4 << 10, 1 << 20, 64 << 20)
"""One size per regime: latency-bound, in between, bandwidth-bound."""

ROUNDS = 11
"""Timed calls of each candidate at each size (after one untimed warm-up call)."""

ENV_TUNING_DIR = "COLLECTIVES_TUNING_DIR"
"""Where tuning files live; default ~/.cache/collectives."""


def default_cache_dir() -> Path:
    return Path(os.environ.get(ENV_TUNING_DIR) or Path.home() / ".cache" / "collectives")


def cache_file(directory: str | os.PathLike, fingerprint: str) -> Path:
    return Path(directory) / f"tuning-{fingerprint}.json"


def _cache_fingerprint(topology: Topology, backend: str, segment_bytes: int) -> str:
    """What a tuning file is valid for: this node layout on `backend` (a transport's class name),
    at this segment size, measured by this version of the library."""
    return topology.fingerprint(f"{backend}|segment={segment_bytes}|{__version__}")


def load_or_measure(
    comm: Communicator,
    sizes: Sequence[int],
    *,
    backend: str,
    cache_dir: str | os.PathLike | None,
    use_cache: bool,
) -> tuple[LinkCosts, Tuning]:
    """The link costs and tuning of `comm`'s world (a collective, identical on every rank).

    Read from the cache file for this layout when there is one (and `use_cache`); otherwise probed
    and measured at `sizes`, and saved when `use_cache`. `cache_dir` None means `default_cache_dir()`.
    """
    fingerprint = _cache_fingerprint(comm.topology, backend, comm.segment_bytes)
    path = cache_file(cache_dir if cache_dir is not None else default_cache_dir(), fingerprint)
    if use_cache and (cached := _read_shared(comm, path, fingerprint)) is not None:
        return cached
    costs = comm.probe()
    tuning = measure(comm, Selector(comm.topology, costs, comm.segment_bytes), sorted(sizes))
    if use_cache and comm.rank == 0:
        _write_atomically(path, encode(costs, tuning, fingerprint))
    return costs, tuning


def _read_shared(comm: Communicator, path: Path, fingerprint: str) -> tuple[LinkCosts, Tuning] | None:
    """Rank 0's copy of a tuning file, broadcast so that every rank decodes the same bytes (a
    collective); None when rank 0 has none or it is for something else."""
    data = b""
    if comm.rank == 0:
        try:
            data = path.read_bytes()
        except OSError:
            pass
    length = int(comm.broadcast(np.array([len(data)], dtype=np.int64))[0])
    if length == 0:
        return None
    payload = np.frombuffer(data, dtype=np.uint8) if comm.rank == 0 else np.empty(length, dtype=np.uint8)
    return decode(comm.broadcast(payload).tobytes(), fingerprint)


def _write_atomically(path: Path, data: bytes) -> None:
    """Replace the file at `path` with `data` at once (through a scratch file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_bytes(data)
    scratch.replace(path)


def measure(comm: Communicator, selector: Selector, sizes: Sequence[int], *, rounds: int = ROUNDS) -> Tuning:
    """Time every candidate at each size on `comm` (a collective), interleaved round by round."""
    clock = comm.clock
    ratios: dict[str, list[float | None]] = {a: [None] * len(sizes) for a in selector.candidates}
    for index, nbytes in enumerate(sizes):
        predicted = selector.predictions(nbytes)
        src = np.ones(max(1, nbytes // 4), dtype=np.float32)
        out = np.empty_like(src)
        for algorithm in selector.candidates:
            comm.allreduce(src, algorithm=algorithm, out=out)  # warm up
        times: dict[str, list[float]] = {a: [] for a in selector.candidates}
        for _ in range(rounds):
            for algorithm in selector.candidates:
                comm.barrier()
                start = clock()
                comm.allreduce(src, algorithm=algorithm, out=out)
                times[algorithm].append(clock() - start)
        for algorithm, samples in times.items():
            slowest = comm.allreduce(np.array(samples), op="max")
            if predicted[algorithm] > 0:
                ratios[algorithm][index] = float(np.median(slowest)) / predicted[algorithm]
    return Tuning(tuple(sizes), {a: tuple(r) for a, r in ratios.items() if any(x is not None for x in r)})


def encode(costs: LinkCosts, tuning: Tuning, fingerprint: str) -> bytes:
    record = {
        "version": __version__,
        "fingerprint": fingerprint,
        "costs": dataclasses.asdict(costs),
        "tuning": {"sizes": list(tuning.sizes), "ratios": {a: list(r) for a, r in tuning.ratios.items()}},
    }
    return json.dumps(record, indent=1).encode()


def decode(data: bytes, fingerprint: str) -> tuple[LinkCosts, Tuning] | None:
    """The costs and tuning in a cache file's contents, or None if it is for something else."""
    try:
        record = json.loads(data)
        if record.get("fingerprint") != fingerprint or record.get("version") != __version__:
            return None
        c = record["costs"]
        costs = LinkCosts(
            intra=LinkCost(**c["intra"]),
            inter=LinkCost(**c["inter"]),
            nic_beta=c["nic_beta"],
            gamma=c["gamma"],
            measured=c["measured"],
        )
        t = record["tuning"]
        tuning = Tuning(tuple(t["sizes"]), {a: tuple(r) for a, r in t["ratios"].items()})
    except (ValueError, KeyError, TypeError):
        return None
    return costs, tuning

"""The measured tuning pass behind `Communicator.tune()`, and its cache file.

The cost model gets the shape of each algorithm's cost right but not everything a real backend
adds (Python overhead per message, thread wake-ups, cache effects). So at a few sizes the pass
times the model's top candidates for real and keeps measured / predicted for each (`Tuning`), which
the selector multiplies its predictions by. Times are the slowest rank's, median of repeats, and
pass through an all-reduce, so every rank keeps identical numbers.

The probed link costs and the ratios are saved as JSON under a name made from the topology's
fingerprint (backend, node layout, segment size, library version). Rank 0 reads the file and
broadcasts it, so a second run with the same layout starts tuned without measuring, and ranks on
different machines cannot end up with different files' contents.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ._version import __version__
from .selector import Selector, Tuning
from .topology import LinkCost, LinkCosts

if TYPE_CHECKING:
    from .communicator import Communicator

TUNE_SIZES = (4 << 10, 1 << 20, 64 << 20)
"""One size per regime: latency-bound, in between, bandwidth-bound."""

TOP_CANDIDATES = 3
"""How many of the model's best candidates are timed at each size."""

REPEATS = 5

ENV_TUNING_DIR = "COLLECTIVES_TUNING_DIR"
"""Where tuning files live; default ~/.cache/collectives."""


def default_cache_dir() -> Path:
    return Path(os.environ.get(ENV_TUNING_DIR) or Path.home() / ".cache" / "collectives")


def cache_file(directory: str | os.PathLike, fingerprint: str) -> Path:
    return Path(directory) / f"tuning-{fingerprint}.json"


def measure(
    comm: "Communicator", selector: Selector, sizes: Sequence[int], *, top: int = TOP_CANDIDATES, repeats: int = REPEATS
) -> Tuning:
    """Time the `top` predicted-best candidates at each size on `comm` (a collective)."""
    clock = comm.clock
    ratios: dict[str, list[float | None]] = {a: [None] * len(sizes) for a in selector.candidates}
    for index, nbytes in enumerate(sizes):
        predicted = selector.predictions(nbytes)
        ranked = sorted(selector.candidates, key=predicted.__getitem__)[:top]
        src = np.ones(max(1, nbytes // 4), dtype=np.float32)
        out = np.empty_like(src)
        for algorithm in ranked:
            comm.allreduce(src, algorithm=algorithm, out=out)  # warm up
            times = []
            for _ in range(repeats):
                comm.barrier()
                start = clock()
                comm.allreduce(src, algorithm=algorithm, out=out)
                times.append(clock() - start)
            slowest = comm.allreduce(np.array(times), op="max")
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
            intra=LinkCost(**c["intra"]), inter=LinkCost(**c["inter"]), nic_beta=c["nic_beta"], gamma=c["gamma"], measured=c["measured"]
        )
        t = record["tuning"]
        tuning = Tuning(tuple(t["sizes"]), {a: tuple(r) for a, r in t["ratios"].items()})
    except (ValueError, KeyError, TypeError):
        return None
    return costs, tuning

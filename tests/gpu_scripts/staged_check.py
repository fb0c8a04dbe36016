"""Every all-reduce algorithm (native included where the backend has one) on CuPy arrays, over
the backend `init()` finds (MPI or gRPC, staged through pinned host memory): results on the
input's GPU, exact (integer-valued inputs), identical on every rank."""

from __future__ import annotations

import sys

import cupy
import numpy as np

import collectives


def main() -> int:
    comm = collectives.init(timeout=60)
    cupy.cuda.Device(comm.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
    for count in (0, 1, 1000, 300_001):
        host = np.arange(count, dtype=np.float32) % 7 + comm.rank
        expected = (np.arange(count, dtype=np.float32) % 7) * comm.size + sum(range(comm.size))
        for algorithm in comm.algorithms:
            if algorithm == "reference" and count > 1000:
                continue
            result = comm.allreduce(cupy.asarray(host), algorithm=algorithm)
            assert isinstance(result, cupy.ndarray), f"{algorithm}: got {type(result).__name__}"
            assert result.device.id == cupy.cuda.Device().id
            np.testing.assert_array_equal(cupy.asnumpy(result), expected, err_msg=f"{algorithm}, {count}")
    gathered = comm.allgather(cupy.full(3, comm.rank, dtype=cupy.int64))
    np.testing.assert_array_equal(cupy.asnumpy(gathered), np.repeat(np.arange(comm.size), 3))
    print(f"rank {comm.rank}: staged ok", flush=True)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

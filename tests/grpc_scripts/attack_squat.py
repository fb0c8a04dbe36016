"""``python attack_squat.py ADDRESS OUTPUT SECONDS``: squat a rank's port without the secret.

Binds ADDRESS before the rank does, answers every call with garbage, records everything callers
send (method, metadata keys and values, bodies) and after SECONDS writes it all to OUTPUT and
exits. Prints ``LISTENING`` once bound.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from intruder import Squatter


def main(address: str, output: str, seconds: str) -> int:
    squatter = Squatter(address)
    print("LISTENING", flush=True)
    try:
        time.sleep(float(seconds))
    finally:
        squatter.stop()
        Path(output).write_bytes(squatter.captured())
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

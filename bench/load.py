"""The benches' concurrent load process (a publisher/consumer in its own
process that reports samples on a queue): waiting for it to get going,
stopping it and collecting what it reported, in one place."""

from __future__ import annotations

import time
from typing import Any


def wait_confirmed(sq: Any, samples: list, ready: Any, confirmed: int, what: str, timeout: float = 60.0) -> None:
    """Wait until the load process (started, ``ready`` its start event)
    reports ``confirmed`` confirms, appending its samples; RuntimeError
    naming ``what`` if it stops or makes no progress within ``timeout``."""
    ready.wait(timeout)
    deadline = time.monotonic() + timeout
    while True:
        s = sq.get(timeout=30)
        if s[0] in ("end", "error"):
            raise RuntimeError(f"{what}: publisher stopped early: {s}")
        samples.append(s)
        if s[1] >= confirmed:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: publisher made no progress: {s}")


def stop_load(stop: Any, proc: Any, sq: Any, samples: list, timeout: float = 90.0) -> Any:
    """Tell the load process to stop, append its samples to ``samples`` until
    its final ``("end", ...)`` or ``("error", ...)`` record, which is
    returned (None if it never came), and make sure the process is gone."""
    stop.set()
    end = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            s = sq.get(timeout=5)
        except Exception:  # queue.Empty: look whether it is still alive
            if not proc.is_alive():
                break
            continue
        if s[0] in ("end", "error"):
            end = s
            break
        samples.append(s)
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return end

"""mirrorq.stack_room: a call under run_with_room passes its result and
exceptions through, and calls made under it at any depth a node process
reaches map no frame-stack chunk (counted with strace, against the same
calls without it, which do)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from mirrorq.stack_room import run_with_room

# Recurse to every depth up to 400 frames (~45 KB; a node process's turns reach ~16 KB) and
# call a leaf 50 times at the bottom: where a callee lands on a chunk
# boundary, each of those calls maps and unmaps a chunk.
_CHILD = """
import sys
from mirrorq.stack_room import run_with_room

def leaf(x):
    return x + 1

def deep(d):
    if d:
        return deep(d - 1)
    s = 0
    for _ in range(50):
        s = leaf(s)
    return s

def scan():
    return sum(deep(d) for d in range(1, 400))

print(run_with_room(scan) if sys.argv[1] == "room" else scan())
"""


_CHUNK_MAP = re.compile(r"^\d+\s+mmap\(NULL, (16384|32768), [^,]+, [^,]*MAP_ANONYMOUS[^,]*, -1, 0\)")


def _chunk_maps(mode: str, tmp_path) -> int:
    """Anonymous 16/32 KiB mappings the child made: a frame-stack chunk each."""
    trace = tmp_path / f"{mode}.strace"
    out = subprocess.run(
        ["strace", "-f", "-qq", "-e", "trace=mmap", "-o", str(trace), sys.executable, "-c", _CHILD, mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0 and not trace.exists():
        pytest.skip(f"strace cannot trace here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(399 * 50)
    return sum(1 for ln in trace.read_text().splitlines() if _CHUNK_MAP.match(ln))


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_deep_calls_under_it_map_no_chunk(tmp_path):
    without = _chunk_maps("plain", tmp_path)
    with_room = _chunk_maps("room", tmp_path)
    assert without > 100, without  # the boundary is hit: the check can see it
    assert with_room < 5, with_room


def test_result_and_exceptions_pass_through():
    assert run_with_room(lambda a, b=0: a + b, 2, b=3) == 5

    def boom():
        raise KeyError("x")

    with pytest.raises(KeyError):
        run_with_room(boom)
    with pytest.raises(TypeError, match="needs a callable"):
        run_with_room(42)

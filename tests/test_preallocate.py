"""mirrorq.preallocate: how far ahead of its records a log writes zeros."""

import os

import pytest

from mirrorq import preallocate as P


@pytest.mark.parametrize("end", [0, 1, 100, 4095, 4096, 40_000, 1 << 20, 7_654_321, 100 << 20])
@pytest.mark.parametrize("cap", [0, 3000, 16 << 20, 1 << 40])
def test_target_is_an_eighth_ahead_within_bounds_to_a_page_and_under_the_cap(end, cap):
    t = P.target(end, cap)
    assert t >= end  # never cuts records
    if cap <= end:
        assert t == end
        return
    assert t <= cap
    if t < cap:
        assert t % P.MIN_BYTES == 0
        ahead = t - end
        want = min(P.MAX_BYTES, max(P.MIN_BYTES, end // 8))
        assert want <= ahead < want + P.MIN_BYTES


def test_extend_writes_zeros_only_past_the_records_and_only_when_they_pass_the_file(tmp_path):
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, b"r" * 5000, 0)
        n = P.extend(fd, 5000, 0, 1 << 30)
        assert n == P.target(5000, 1 << 30) == os.fstat(fd).st_size
        data = path.read_bytes()
        assert data[:5000] == b"r" * 5000 and not any(data[5000:])
        os.pwrite(fd, b"s" * 100, 5000)
        assert P.extend(fd, 5100, n, 1 << 30) == n == os.fstat(fd).st_size  # inside the zeros: nothing written
    finally:
        os.close(fd)

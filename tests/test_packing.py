"""mirrorq.packing.pack: the bytes msgpack.packb gives, from a Packer that is reused."""

import random

import msgpack
import pytest

from mirrorq import packing


def _value(rng: random.Random, depth: int = 0):
    kinds = ["int", "str", "bytes", "bool", "none", "float"] + (["list", "dict"] if depth < 3 else [])
    k = rng.choice(kinds)
    if k == "int":
        return rng.choice([rng.randrange(-(2**63), 2**64), rng.randrange(-40, 300)])
    if k == "str":
        return "".join(rng.choice("aé€🐇z") for _ in range(rng.randrange(0, 40)))
    if k == "bytes":
        return rng.randbytes(rng.choice([0, 1, 31, 255, 1024, 70000]))
    if k == "bool":
        return rng.random() < 0.5
    if k == "none":
        return None
    if k == "float":
        return rng.uniform(-1e9, 1e9)
    if k == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    return {str(i): _value(rng, depth + 1) for i in range(rng.randrange(0, 6))}


@pytest.mark.parametrize("seed", range(20))
def test_same_bytes_as_packb_and_round_trips(seed):
    rng = random.Random(seed)
    for _ in range(50):
        v = _value(rng)
        out = packing.pack(v)
        assert out == msgpack.packb(v, use_bin_type=True)
        assert msgpack.unpackb(out, raw=False, strict_map_key=False) == v


def test_a_failed_pack_raises_what_packb_raises_and_leaves_nothing_behind():
    with pytest.raises(TypeError) as mine:
        packing.pack([1, b"half written", object()])
    with pytest.raises(TypeError) as theirs:
        msgpack.packb([1, b"half written", object()], use_bin_type=True)
    assert str(mine.value) == str(theirs.value)
    # the half-packed prefix is not prepended to the next result
    assert packing.pack([2]) == b"\x91\x02"


def test_the_packer_is_reused_and_one_grown_past_keep_bytes_is_dropped():
    packing.pack(0)
    first = packing._local.packer
    packing.pack([1, "x"])
    assert packing._local.packer is first
    big = b"y" * (packing.KEEP_BYTES + 1)
    assert packing.pack(big) == msgpack.packb(big, use_bin_type=True)
    assert packing._local.packer is None
    packing.pack(1)
    assert packing._local.packer is not None and packing._local.packer is not first


def test_each_thread_has_its_own_packer():
    import threading

    packing.pack(0)
    mine = packing._local.packer
    seen = []

    def other():
        packing.pack(1)
        seen.append(packing._local.packer)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen[0] is not None and seen[0] is not mine

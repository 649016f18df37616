"""mirrorq.node.wire's serializer: nothing is unpickled without the secret."""

from __future__ import annotations

import os
import pickle

import pytest

from mirrorq.node import wire


class Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def ser(*keys):
    s = wire.AuthSerializer()
    for k in keys:
        s.add_key(k)
    return s


def test_round_trip_and_control_packets():
    s = ser(b"k" * 64)
    assert s.loads(s.dumps({"a": [1, 2]})) == {"a": [1, 2]}
    from thespian.system.transport.streamBuffer import ackDataErrPacket, ackPacket

    assert s.loads(pickle.dumps(ackPacket)) == ackPacket
    assert s.loads(pickle.dumps(ackDataErrPacket)) == ackDataErrPacket


def test_nothing_is_unpickled_without_the_right_mac(tmp_path):
    marker = tmp_path / "pwned"
    node = ser(b"k" * 64)
    for frame in (
        pickle.dumps(Evil(str(marker))),  # Thespian's bare wire
        ser(b"x" * 64).dumps(Evil(str(marker))),  # another cluster's key
        wire.MAGIC + b"\x01" + os.urandom(32) + pickle.dumps(Evil(str(marker))),  # forged MAC
        wire.MAGIC + b"\x05" + pickle.dumps(Evil(str(marker))),  # truncated
        b"",
    ):
        with pytest.raises(wire.RefusedMessage):
            node.loads(frame)
    assert not marker.exists()
    assert node.refused == 5
    node.loads(ser(b"k" * 64).dumps(Evil(str(marker))))  # control: signed, it is unpickled
    assert marker.exists()


def test_a_tool_with_several_secrets_is_understood_by_each_cluster():
    tool = ser(b"a" * 64, b"b" * 64)
    assert ser(b"b" * 64).loads(tool.dumps("hi")) == "hi"
    assert ser(b"a" * 64).loads(tool.dumps("hi")) == "hi"


def test_secret_file_is_created_private_once(tmp_path):
    p = wire.create_secret(tmp_path)
    assert os.stat(p).st_mode & 0o777 == 0o600
    first = wire.read_secret(p)
    assert wire.create_secret(tmp_path) == p and wire.read_secret(p) == first
    os.chmod(p, 0o640)
    with pytest.raises(PermissionError):
        wire.read_secret(p)

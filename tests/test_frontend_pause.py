"""The front end under pause_minority, and its answer to a master's probe.

A node in a minority closes every client with 320 CONNECTION_FORCED naming
the minority, and each client that connects meanwhile once its handshake is
done (so it reads the reason, not a dropped socket); back in the majority it
takes clients again.  A master's ``FrontEndProbe`` is answered with the keys
of the live connections, so the master drops the channels of connections
closed while it could not hear of it.
"""

from __future__ import annotations

import test_amqp_frontend
from pamqp import commands as C
from pamqp import frame as F

from mirrorq.amqp.frontend import FrontEnd
from mirrorq.node.messages import NodeEvent
from mirrorq.queues import messages as qm

DST = "127.0.0.1:45881"


class Host(test_amqp_frontend.Host):
    """test_amqp_frontend's host, keeping what each connection was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.out: dict[int, bytearray] = {}

    def fe_write(self, no, data):
        self.out.setdefault(no, bytearray()).extend(data)
        return True


def frames(host: Host, no: int) -> list:
    buf, out = bytes(host.out.get(no, b"")), []
    while buf:
        n, _ch, value = F.unmarshal(buf)
        buf = buf[n:]
        out.append(value)
    return out


def handshake(fe: FrontEnd, host: Host, now: float = 0.0) -> int:
    no = fe.open(now, "127.0.0.1", 50000)
    fe.data(now, no, b"AMQP\x00\x00\x09\x01")
    fe.data(
        now,
        no,
        F.marshal(
            C.Connection.StartOk(client_properties={}, mechanism="PLAIN", response="\0guest\0guest", locale="en_US"), 0
        ),
    )
    tune = next(f for f in frames(host, no) if isinstance(f, C.Connection.Tune))
    fe.data(now, no, F.marshal(C.Connection.TuneOk(tune.channel_max, tune.frame_max, 0), 0))
    fe.data(now, no, F.marshal(C.Connection.Open(virtual_host="/"), 0))
    return no


def closes(host: Host, no: int) -> list:
    return [(f.reply_code, f.reply_text) for f in frames(host, no) if isinstance(f, C.Connection.Close)]


REASON = "node n3 is in a minority (pause_minority): it reaches n3 of the cluster n1, n2, n3"


def test_a_paused_front_end_closes_its_clients_and_each_new_one_with_320():
    host = Host()
    fe = FrontEnd(host, node="n3", dst=DST)
    before = handshake(fe, host)
    assert any(isinstance(f, C.Connection.OpenOk) for f in frames(host, before)) and not closes(host, before)
    fe.message(1.0, None, NodeEvent("paused", "n3", 1, REASON))
    assert closes(host, before) == [(320, f"CONNECTION_FORCED - {REASON}")]
    during = handshake(fe, host, 2.0)
    fs = frames(host, during)
    assert isinstance(fs[-2], C.Connection.OpenOk) and closes(host, during) == [(320, f"CONNECTION_FORCED - {REASON}")]
    fe.message(3.0, None, NodeEvent("resumed", "n3", 1))
    after = handshake(fe, host, 4.0)
    assert any(isinstance(f, C.Connection.OpenOk) for f in frames(host, after)) and not closes(host, after)


def test_a_probe_is_answered_with_the_keys_of_live_connections_only():
    host = Host()
    fe = FrontEnd(host, node="n3", dst=DST)
    a, b = handshake(fe, host), handshake(fe, host)
    key_a, key_b = fe.conns[a].key, fe.conns[b].key
    fe.lost(1.0, a)  # its socket went away
    fe.message(2.0, None, qm.FrontEndProbe("n1/127.0.0.1:1/m"))
    ((dst, answer),) = [(d, m) for d, m in host.sent if isinstance(m, qm.FrontEndChannels)]
    assert dst == "n1/127.0.0.1:1/m" and answer.dst == DST
    assert key_b in answer.keys and key_a not in answer.keys


def test_the_asyncio_shell_follows_the_majority_lease_before_it_handles_anything(tmp_path):
    """The asyncio shell reads the lease the node agent writes before each
    thing it hands the front end, as the watch listener does: a lapsed or
    withdrawn lease pauses its clients (320) even before the agent's
    "paused" event reaches it; a renewed one resumes."""
    from mirrorq.amqp.aio_shell import AioShell
    from mirrorq.node.lease import LeaseWriter

    lease = LeaseWriter(str(tmp_path))
    lease.write(100.0)  # serving until t=100
    shell = AioShell({"name": "n3", "amqp_port": 5672, "data_dir": str(tmp_path)}, DST)
    host = Host()
    shell.fe.host = host
    no = handshake(shell.fe, host)
    shell.follow_lease(1.0)
    assert not closes(host, no) and not shell.fe.paused
    lease.write(0.0)  # the agent withdrew it: a minority
    shell.follow_lease(2.0)
    ((code, text),) = closes(host, no)
    assert code == 320 and "minority" in text and "n3" in text
    lease.write(200.0)
    shell.follow_lease(3.0)
    assert not shell.fe.paused
    later = handshake(shell.fe, host, 4.0)
    assert not closes(host, later)
    lease.close()

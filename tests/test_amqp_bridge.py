"""The asyncio shell's bridge: framing, one frame per event-loop turn, and the
shell end to end in-process (a real aio-pika client, the test playing the
bridge actor with in-memory queue masters -- no Thespian)."""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct

import pytest
from amqp_harness import LocalMaster
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrorq.amqp import bridge as br
from mirrorq.amqp.aio_shell import AioShell
from mirrorq.node.messages import (
    AlarmSubscribe,
    RegistryGet,
    RegistryResult,
    RegistryRows,
    RegistrySubscribe,
    RegistryTxn,
    ResourceAlarms,
    Subscribe,
)
from mirrorq.queues import messages as qm
from mirrorq.queues.control import FrontEndAt
from mirrorq.queues.manager import DeclareQueue, DeclareResult

aio_pika = pytest.importorskip("aio_pika")


# ---- framing ----------------------------------------------------------------------------------
def test_roundtrip_of_real_messages():
    batch = [
        ("127.0.0.1:4000", qm.Publish("q", ("127.0.0.1:1", 1 << 32), ((1, b"body", {"h": 1}, True),))),
        (br.AGENT, RegistryGet("amqqueue", linearizable=True)),
        ("m:1", RegistryRows(True, [{"name": "q"}])),
    ]
    d = br.Decoder()
    assert d.feed(br.encode(batch) + br.encode([])) == [batch, []]
    assert d.buf == b""


items = st.lists(
    st.tuples(st.text(max_size=12), st.one_of(st.binary(max_size=64), st.integers(), st.none())), max_size=8
)


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(items, max_size=6), cuts=st.lists(st.integers(0, 2000), max_size=12))
def test_decoder_returns_the_frames_in_order_however_the_stream_is_split(batches, cuts):
    stream = b"".join(br.encode(b) for b in batches)
    d = br.Decoder()
    got = []
    last = 0
    for cut in sorted(c for c in cuts if c <= len(stream)) + [len(stream)]:
        got += d.feed(stream[last:cut])
        last = cut
    assert got == batches
    assert d.buf == b""


def test_a_partial_frame_waits_for_the_rest():
    frame = br.encode([("a", 1)])
    d = br.Decoder()
    assert d.feed(frame[:3]) == []
    assert d.feed(frame[3:-1]) == []
    assert d.feed(frame[-1:]) == [[("a", 1)]]


def test_oversized_length_is_refused_naming_it():
    d = br.Decoder(max_frame=100)
    with pytest.raises(br.BridgeFramingError, match="length 101 exceeds the maximum \\(100\\)"):
        d.feed(struct.pack(">I", 101))


def test_encode_refuses_an_oversized_batch(monkeypatch):
    monkeypatch.setattr(br, "MAX_FRAME", 50)
    with pytest.raises(br.BridgeFramingError, match="exceeds MAX_FRAME"):
        br.encode([("x", b"y" * 100)])


def test_a_turns_items_leave_in_frames_of_at_most_the_batch_bound():
    """What one side has for the other in a turn (ten 1 MiB publishes) is
    cut into frames of at most MAX_BATCH_BYTES of messages, in order; the
    decoder gets every item back once."""
    from mirrorq.bounds import MAX_BATCH_BYTES
    from mirrorq.queues import messages as qm

    items = [("q:1", qm.Publish("q", ("fe", 1), ((i + 1, bytes([i]) * (1 << 20), {}, True),))) for i in range(10)]
    out = br.frames(items)
    assert len(out) == 4
    assert all(len(f) <= MAX_BATCH_BYTES for f in out)
    d = br.Decoder()
    got = [it for f in out for batch in d.feed(f) for it in batch]
    assert got == items


def test_garbage_and_non_list_payloads_are_refused():
    with pytest.raises(br.BridgeFramingError, match="does not unpickle"):
        br.Decoder().feed(struct.pack(">I", 4) + b"\x00\x01\x02\x03")
    payload = pickle.dumps({"not": "a list"})
    with pytest.raises(br.BridgeFramingError, match="carries a list, got dict"):
        br.Decoder().feed(struct.pack(">I", len(payload)) + payload)
    with pytest.raises(br.BridgeFramingError, match="carries a list, got tuple"):
        br.encode(("a", 1))


# ---- the shell: one bridge frame per loop turn --------------------------------------------------
class _Capture:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False


def test_everything_for_actors_in_one_loop_turn_leaves_in_one_frame(tmp_path):
    async def main():
        shell = AioShell({"name": "n1", "data_dir": str(tmp_path), "amqp_port": 1}, "127.0.0.1:9")
        shell.loop = asyncio.get_running_loop()
        shell.bridge = _Capture()

        def turn(k: int) -> None:
            for i in range(k):
                shell.fe_send(f"10.0.0.{i % 3}:1", ("m", i))
            shell.fe_agent("to-agent")
            shell.fe_manager("to-manager")

        shell.loop.call_soon(turn, 30)
        await asyncio.sleep(0)  # the turn that calls `turn`
        await asyncio.sleep(0)  # the flush scheduled by it
        assert len(shell.bridge.writes) == 1
        [frame] = br.Decoder().feed(shell.bridge.writes[0])
        assert frame == [(f"10.0.0.{i % 3}:1", ("m", i)) for i in range(30)] + [
            (br.AGENT, "to-agent"),
            (br.MANAGER, "to-manager"),
        ]
        # the bridge has not answered that frame: the next turns' messages wait, and leave as one frame
        for k in (2, 1):
            shell.loop.call_soon(turn, k)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        assert len(shell.bridge.writes) == 1 and shell.inflight == 1
        shell.from_bridge([(br.CREDIT, 1)])
        assert len(shell.bridge.writes) == 2 and shell.inflight == 1
        [frame] = br.Decoder().feed(shell.bridge.writes[1])
        assert [d for d, _ in frame] == [
            "10.0.0.0:1",
            "10.0.0.1:1",
            br.AGENT,
            br.MANAGER,
            "10.0.0.0:1",
            br.AGENT,
            br.MANAGER,
        ]

    asyncio.run(main())


# ---- the shell end to end, the test playing the bridge ---------------------------------------------
class FakeBridge:
    """Answers what the shell sends as the bridge actor and the node's actors would."""

    def __init__(self, reader, writer, dst: str) -> None:
        self.reader, self.writer, self.dst = reader, writer, dst
        self.masters: dict[str, LocalMaster] = {}
        self.frames: list[list] = []
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.subscribed = False
        self.credit_delay = 0.0

    async def serve(self) -> None:
        d = br.Decoder()
        while True:
            data = await self.reader.read(1 << 16)
            if not data:
                return
            for items in d.feed(data):
                self.frames.append(items)
                out = []
                for dst, msg in items:
                    out += self.handle(dst, msg)
                if out:
                    self.writer.write(br.encode(out))
                # as the bridge does once a frame's sends are out; a busy one (Thespian) takes a while
                asyncio.get_running_loop().call_later(self.credit_delay, self.writer.write, br.encode([(br.CREDIT, 1)]))

    def handle(self, dst: str, msg) -> list:
        if dst == br.READY:
            self.ready.set_result(msg)
            return []
        if dst == br.AGENT:
            if isinstance(msg, RegistrySubscribe):
                self.subscribed = True
                return []
            if isinstance(msg, Subscribe):  # node events: none happen here
                return []
            if isinstance(msg, AlarmSubscribe):  # as the agent answers: the alarms in effect (none)
                return [("agent:1", ResourceAlarms(()))]
            if isinstance(msg, RegistryGet):
                return [("agent:1", RegistryRows(True, [], ref=msg.ref))]  # the agent echoes request ids
            assert isinstance(msg, RegistryTxn), msg
            return [("agent:1", RegistryResult(True, ref=msg.ref))]
        if dst == br.MANAGER:
            if isinstance(msg, FrontEndAt):  # where the node's masters dead-letter: none here
                self.front_end_at = msg.dst
                return []
            assert isinstance(msg, DeclareQueue), msg
            spec = dict(msg.spec)
            m = next((m for m in self.masters.values() if m.spec["name"] == spec["name"]), None)
            if m is None:
                m = LocalMaster(len(self.masters) + 1, spec)
                self.masters[m.dst] = m
            rec = dict(
                spec, pid=m.member, slave_pids=[], sync_slave_pids=[], gm_pids=[m.member], policy=None, state="live"
            )
            return [("manager:1", DeclareResult(True, rec))]
        m = self.masters[dst]
        return [(m.dst, reply) for to, reply in m.handle(0.0, msg) if to == self.dst]


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


async def _shell_and_bridge(tmp_path, dst: str):
    """An asyncio shell on a free port whose bridge is a FakeBridge, once it reported ready:
    (shell, its task, the bridge's writer, the fake, the fake's task, the port)."""
    mine, theirs = socket.socketpair()
    port = _free_port()
    shell = AioShell({"name": "n1", "host": "127.0.0.1", "data_dir": str(tmp_path), "amqp_port": port}, dst)
    run = asyncio.create_task(shell.run(theirs.detach()))
    reader, writer = await asyncio.open_connection(sock=mine)
    fake = FakeBridge(reader, writer, dst)
    serving = asyncio.create_task(fake.serve())
    assert await asyncio.wait_for(fake.ready, 10) == port
    return shell, run, writer, fake, serving, port


def test_aio_shell_serves_aio_pika_through_the_bridge(tmp_path):
    dst = "127.0.0.1:9"

    async def main():
        shell, run, writer, fake, serving, port = await _shell_and_bridge(tmp_path, dst)
        conn = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{port}/")
        async with conn:
            ch = await conn.channel(publisher_confirms=True)
            q = await ch.declare_queue("aq", durable=True)
            fake.credit_delay = 0.02
            await asyncio.gather(
                *(ch.default_exchange.publish(aio_pika.Message(b"m%d" % i), routing_key="aq") for i in range(200))
            )
            bodies = []
            async with q.iterator() as it:
                async for msg in it:
                    async with msg.process():
                        bodies.append(msg.body)
                    if len(bodies) == 200:
                        break
        assert bodies == [b"m%d" % i for i in range(200)]
        assert fake.subscribed
        publishes = [m for f in fake.frames for d, m in f if isinstance(m, qm.Publish)]
        assert sum(len(p.items) for p in publishes) == 200
        # while the bridge is busy the clients' bytes are held, then fed at once:
        # pipelined publishes travel as few Publish messages of many items
        assert len(publishes) <= 50, f"{len(publishes)} Publish messages for 200 publishes"
        # the bridge going away ends the shell
        writer.close()
        assert await asyncio.wait_for(run, 10) == 0
        serving.cancel()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_aio_shell_reports_a_port_it_cannot_bind(tmp_path):
    async def main():
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        mine, theirs = socket.socketpair()
        shell = AioShell(
            {"name": "n1", "host": "127.0.0.1", "data_dir": str(tmp_path), "amqp_port": port}, "127.0.0.1:9"
        )
        assert await asyncio.wait_for(shell.run(theirs.detach()), 10) == 1
        reader, writer = await asyncio.open_connection(sock=mine)
        [[(what, text)]] = br.Decoder().feed(await asyncio.wait_for(reader.read(65536), 5))
        assert what == br.FAILED and f"AMQP port {port}" in text
        writer.close()
        taken.close()

    asyncio.run(main())


# ---- choosing the shell ---------------------------------------------------------------------------
def test_amqp_shell_config_key_is_validated_and_defaults_to_watch(tmp_path):
    from mirrorq.admin.cluster import Cluster, ClusterError
    from mirrorq.node.config import ConfigError, from_mapping

    assert from_mapping({"name": "n1"}).amqp_shell == "watch"
    assert from_mapping({"name": "n1", "amqp_shell": "asyncio"}).amqp_shell == "asyncio"
    with pytest.raises(ConfigError, match="key 'amqp_shell': must be one of watch, asyncio, got 'tornado'"):
        from_mapping({"name": "n1", "amqp_shell": "tornado"})
    with pytest.raises(ClusterError, match="amqp shell must be one of watch, asyncio, got 'twisted'"):
        Cluster(tmp_path, amqp_shell="twisted").create(1, 30000, 31000, 0.2, 1.5)
    Cluster(tmp_path, amqp_shell="asyncio").create(2, 30000, 31000, 0.2, 1.5)
    c = Cluster(tmp_path)
    assert [c.config(n).amqp_shell for n in c.node_names()] == ["asyncio", "asyncio"]


class _RawClient:
    """An AMQP 0-9-1 client over asyncio streams speaking pamqp frames, so
    the test decides what is written when (a publish while blocked)."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer

    def send(self, channel: int, *frames) -> None:
        from pamqp import frame as F

        self.writer.write(b"".join(F.marshal(f, channel) for f in frames))

    def publish(self, body: bytes, queue: str) -> None:
        from pamqp import body as B
        from pamqp import commands as C
        from pamqp import header as H

        self.send(
            1,
            C.Basic.Publish(exchange="", routing_key=queue),
            H.ContentHeader(0, len(body), C.Basic.Properties()),
            B.ContentBody(body),
        )

    async def frame(self):
        from pamqp import frame as F

        head = await asyncio.wait_for(self.reader.readexactly(7), 10)
        size = struct.unpack(">I", head[3:7])[0]
        rest = await asyncio.wait_for(self.reader.readexactly(size + 1), 10)
        return F.unmarshal(head + rest)[2]

    async def until(self, cls):
        while not isinstance(f := await self.frame(), cls):
            pass
        return f


def test_aio_shell_stops_reading_a_blocked_publisher_until_the_alarm_clears(tmp_path):
    """The agent's ResourceAlarms reach the asyncio shell through the bridge:
    the publisher gets connection.blocked, its transport is paused (what it
    writes meanwhile is not read: no Publish leaves), and after the alarms
    clear it gets connection.unblocked and its publish goes through."""
    from pamqp import commands as C

    from mirrorq.amqp import connection as cn

    dst = "127.0.0.1:9"

    async def main():
        shell, run, writer, fake, serving, port = await _shell_and_bridge(tmp_path, dst)
        cl = _RawClient(*await asyncio.open_connection("127.0.0.1", port))
        cl.writer.write(cn.PROTOCOL_HEADER)
        await cl.until(C.Connection.Start)
        cl.send(
            0,
            C.Connection.StartOk(
                client_properties={"capabilities": {"connection.blocked": True}}, response="\0guest\0guest"
            ),
        )
        await cl.until(C.Connection.Tune)
        cl.send(0, C.Connection.TuneOk(2047, 131072, 0), C.Connection.Open("/"))
        await cl.until(C.Connection.OpenOk)
        cl.send(1, C.Channel.Open(), C.Confirm.Select(), C.Queue.Declare(queue="bq"))
        await cl.until(C.Queue.DeclareOk)
        cl.publish(b"one", "bq")
        assert (await cl.until(C.Basic.Ack)).delivery_tag == 1

        def published() -> int:
            return sum(len(m.items) for f in fake.frames for _, m in f if isinstance(m, qm.Publish))

        writer.write(br.encode([("agent:1", ResourceAlarms((("n2", "memory"),)))]))
        assert (await cl.until(C.Connection.Blocked)).reason == "low on memory"
        [client] = shell.clients.values()
        assert client.paused and not client.transport.is_reading()
        cl.publish(b"two", "bq")
        await cl.writer.drain()
        # a round trip through the shell on another connection: the loop ran, the blocked one was not read
        other = _RawClient(*await asyncio.open_connection("127.0.0.1", port))
        other.writer.write(cn.PROTOCOL_HEADER)
        await other.until(C.Connection.Start)
        assert published() == 1 and client.paused
        writer.write(br.encode([("agent:1", ResourceAlarms(()))]))
        await cl.until(C.Connection.Unblocked)
        assert (await cl.until(C.Basic.Ack)).delivery_tag == 2
        assert published() == 2 and not client.paused
        for c in (cl, other):
            c.writer.close()
        writer.close()
        assert await asyncio.wait_for(run, 10) == 0
        serving.cancel()

    asyncio.run(asyncio.wait_for(main(), 60))

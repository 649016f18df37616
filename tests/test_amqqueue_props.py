"""AMQQueue against a simple model (hypothesis state machine).

The model: ready messages are a set of offsets (FIFO order is offset order,
also for requeued ones), unacked ones map to the channel (and consumer) that
holds them, and every message ever delivered is remembered.  Every event the
queue emits is checked against the model as it happens:

* a delivery (Deliver, GetOk) and a drop always take the model's head
  (FIFO among ready messages; a requeued message is back at its place);
* ``redelivered`` is true exactly when the message was delivered before;
* a consumer never holds more than its prefetch; no message is delivered
  twice without a requeue in between (it must be ready to be delivered);
* a message is in exactly one of ready / unacked-by-one-channel / gone, and
  an acked message never comes back;
* delivery is work-conserving: after each step either nothing is ready or no
  consumer has credit; with x-max-length (drop-head) the ready count stays
  within the limit;
* a crash (store closed without flushing) and a reopen + promotion yield
  exactly the state of the last flush, with every unacked message requeued.
"""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from mirrorq.classic.amqqueue import (
    TTL_TIMER,
    AMQQueue,
    CancelOk,
    ConsumeOk,
    ConsumerCancelled,
    Deliver,
    GetEmpty,
    GetOk,
    MessagesDropped,
    Publish,
    PublishAccepted,
)
from mirrorq.classic.backing_queue import BackingQueue
from mirrorq.sansio import CancelTimer, Emit, SetTimer

CHANNELS = [("c1", 1), ("c2", 1), ("c3", 1)]
TAGS = ["t1", "t2"]


class QueueMachine(RuleBasedStateMachine):
    @initialize(max_length=st.sampled_from([None, None, 3]))
    def setup(self, max_length):
        self.dir = tempfile.mkdtemp(prefix="amqqueue-props-")
        self.args = {} if max_length is None else {"x-max-length": max_length}
        self.max_length = max_length
        self.bq = BackingQueue(self.dir, fsync=False)
        self.q = AMQQueue("q", self.bq, durable=True, arguments=self.args)
        self.now = 0.0
        self.next_id = 0
        self.ready: set[int] = set()
        self.unacked: dict[int, tuple] = {}  # offset -> (channel, consumer instance or None)
        self.delivered: set[int] = set()
        self.gone: set[int] = set()
        self.body: dict[int, bytes] = {}
        self.consumers: dict[tuple, dict] = {}  # (channel, tag) -> {prefetch, no_ack, cancel, inst}
        self.inst = 0
        self.last_offset = -1
        self.snap = self._snapshot()

    def teardown(self):
        if hasattr(self, "bq"):
            self.bq.close(flush=False)
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------ helpers

    def _snapshot(self):
        return (set(self.ready), dict(self.unacked), set(self.delivered), set(self.gone), dict(self.body))

    def _tick(self):
        self.now += 1.0
        return self.now

    def _held(self, channel):
        return sorted(o for o, (ch, _) in self.unacked.items() if ch == channel)

    def _in_flight(self, key):
        inst = self.consumers[key]["inst"]
        return sum(1 for ch, i in self.unacked.values() if ch == key[0] and i == inst)

    def _take_head(self, offset):
        assert self.ready, f"offset {offset} handed out while the model has nothing ready"
        head = min(self.ready)
        assert offset == head, f"offset {offset} handed out, but the head is {head} (FIFO)"
        self.ready.discard(offset)

    def _hand_out(self, channel, inst, offset, msg, redelivered, ack_required):
        self._take_head(offset)
        assert redelivered == (offset in self.delivered) == msg.redelivered, f"redelivered flag wrong for {offset}"
        assert msg.body == self.body[offset]
        self.delivered.add(offset)
        if ack_required:
            self.unacked[offset] = (channel, inst)
        else:
            self.gone.add(offset)

    def _apply(self, actions):
        for a in actions:
            if not isinstance(a, Emit):
                continue
            e = a.event
            if isinstance(e, PublishAccepted):
                assert e.offset > self.last_offset and e.offset not in self.body
                self.last_offset = e.offset
                self.body[e.offset] = self.pending_bodies[e.publish_id]
                self.ready.add(e.offset)
            elif isinstance(e, Deliver):
                key = (e.channel, e.consumer_tag)
                assert key in self.consumers, f"delivery to unknown consumer {key}"
                c = self.consumers[key]
                assert e.ack_required == (not c["no_ack"])
                self._hand_out(e.channel, c["inst"], e.offset, e.message, e.redelivered, e.ack_required)
                if c["prefetch"] and not c["no_ack"]:
                    assert self._in_flight(key) <= c["prefetch"], f"prefetch of {key} exceeded"
            elif isinstance(e, GetOk):
                self._hand_out(e.channel, None, e.offset, e.message, e.redelivered, e.ack_required)
                assert e.message_count == len(self.ready)
            elif isinstance(e, GetEmpty):
                assert not self.ready
            elif isinstance(e, MessagesDropped):
                if e.reason == "maxlen":
                    for o in e.offsets:
                        self._take_head(o)
                        self.gone.add(o)
                else:
                    assert e.reason == "rejected" and all(o in self.gone for o in e.offsets)
            elif isinstance(e, ConsumerCancelled):
                assert e.reason == "ha-failover"
                c = self.consumers.pop((e.channel, e.consumer_tag))
                assert c["cancel"]
            elif isinstance(e, (ConsumeOk, CancelOk)):
                pass
            else:
                raise AssertionError(f"unexpected event {e!r}")

    # -------------------------------------------------------------- rules

    @rule(n=st.integers(1, 4), size=st.integers(0, 5), channel=st.sampled_from(CHANNELS))
    def publish(self, n, size, channel):
        items = []
        self.pending_bodies = {}
        for _ in range(n):
            i = self.next_id
            self.next_id += 1
            body = bytes([i % 256]) * size
            self.pending_bodies[i] = body
            items.append(Publish(channel, i, f"m{i}", body, {}, True))
        self._apply(self.q.publish_many(self._tick(), items))

    @rule(
        channel=st.sampled_from(CHANNELS),
        tag=st.sampled_from(TAGS),
        prefetch=st.integers(0, 3),
        no_ack=st.booleans(),
        cancel=st.booleans(),
    )
    def consume(self, channel, tag, prefetch, no_ack, cancel):
        if (channel, tag) in self.consumers:
            return
        self.inst += 1
        # the model learns the consumer first: its deliveries follow at once
        self.consumers[(channel, tag)] = {"prefetch": prefetch, "no_ack": no_ack, "cancel": cancel, "inst": self.inst}
        args = {"x-cancel-on-ha-failover": True} if cancel else {}
        self._apply(self.q.consume(self._tick(), channel, tag, no_ack=no_ack, prefetch=prefetch, arguments=args))

    @rule(channel=st.sampled_from(CHANNELS), tag=st.sampled_from(TAGS))
    def cancel(self, channel, tag):
        self.consumers.pop((channel, tag), None)
        acts = self.q.cancel(self._tick(), channel, tag)
        self._apply(acts)

    @rule(channel=st.sampled_from(CHANNELS), no_ack=st.booleans())
    def get(self, channel, no_ack):
        self._apply(self.q.get(self._tick(), channel, ("req", self.now), no_ack=no_ack))

    @rule(channel=st.sampled_from(CHANNELS), data=st.data())
    def ack(self, channel, data):
        candidates = sorted(self.body)  # any offset: others' and gone ones must be ignored
        if not candidates:
            return
        chosen = data.draw(st.lists(st.sampled_from(candidates), max_size=4))
        for o in chosen:
            if self.unacked.get(o, (None,))[0] == channel:
                del self.unacked[o]
                self.gone.add(o)
        self._apply(self.q.ack(self._tick(), channel, chosen))

    @rule(channel=st.sampled_from(CHANNELS), requeue=st.booleans(), data=st.data())
    def reject(self, channel, requeue, data):
        held = self._held(channel)
        if not held:
            return
        chosen = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3, unique=True))
        for o in chosen:
            del self.unacked[o]
            (self.ready if requeue else self.gone).add(o)
        self._apply(self.q.reject(self._tick(), channel, chosen, requeue=requeue))

    @rule(channel=st.sampled_from(CHANNELS))
    def recover(self, channel):
        for o in self._held(channel):
            del self.unacked[o]
            self.ready.add(o)
        self._apply(self.q.recover(self._tick(), channel))

    @rule(channel=st.sampled_from(CHANNELS))
    def channel_down(self, channel):
        for key in [k for k in self.consumers if k[0] == channel]:
            del self.consumers[key]
        for o in self._held(channel):
            del self.unacked[o]
            self.ready.add(o)
        self._apply(self.q.channel_down(self._tick(), channel))

    @rule()
    def purge(self):
        n, acts = self.q.purge(self._tick())
        assert n == len(self.ready)
        self.gone |= self.ready
        self.ready = set()
        self._apply(acts)

    @rule()
    def flush(self):
        self.bq.flush()
        self.snap = self._snapshot()

    @rule()
    def failover(self):
        """A mirror with the same log takes over, knowing the consumer table."""
        table = self.q.consumers
        assert [(c.channel, c.consumer_tag) for c in table] == sorted(
            self.consumers, key=lambda k: self.consumers[k]["inst"]
        )
        self.q = AMQQueue("q", self.bq, durable=True, arguments=self.args, consumers=table)
        self._requeue_all()
        self._apply(self.q.promote(self._tick()))

    @rule()
    def crash_and_restart(self):
        self.bq.close(flush=False)
        self.bq = BackingQueue(self.dir, fsync=False)
        self.q = AMQQueue("q", self.bq, durable=True, arguments=self.args)
        ready, unacked, delivered, gone, body = self.snap
        lost = set(self.body) - set(body)
        self.ready, self.unacked, self.delivered, self.gone, self.body = (
            set(ready),
            dict(unacked),
            set(delivered),
            set(gone),
            dict(body),
        )
        self.last_offset = max(self.body, default=-1)
        assert all(o >= self.bq.log.next_offset for o in lost)  # unflushed publishes are gone, offsets reused
        self.consumers = {}
        self._requeue_all()
        self._apply(self.q.promote(self._tick()))

    def _requeue_all(self):
        for o in list(self.unacked):
            del self.unacked[o]
            self.ready.add(o)

    # --------------------------------------------------------- invariants

    @invariant()
    def store_matches_model(self):
        if not hasattr(self, "q"):
            return
        bq, q = self.bq, self.q
        assert bq.ready_offsets() == sorted(self.ready)
        assert bq.unacked_offsets() == sorted(self.unacked)
        assert not (self.gone & (self.ready | set(self.unacked))), "an acked or dropped message came back"
        assert not (self.ready & set(self.unacked))
        for ch in CHANNELS:
            assert q.unacked_by(ch) == self._held(ch)
        for m in bq.peek(bq.ready_count):
            assert m.redelivered == (m.offset in self.delivered)
        info = q.info()
        assert info["message_bytes_ready"] == sum(len(self.body[o]) for o in self.ready)
        assert info["message_bytes_unacknowledged"] == sum(len(self.body[o]) for o in self.unacked)
        assert [(c.channel, c.consumer_tag) for c in q.consumers] == sorted(
            self.consumers, key=lambda k: self.consumers[k]["inst"]
        )
        credit = False
        for key, c in self.consumers.items():
            held = q.in_flight(*key)
            assert held == self._in_flight(key)
            if c["no_ack"] or not c["prefetch"]:
                credit = True
            else:
                assert held <= c["prefetch"]
                credit |= held < c["prefetch"]
        if credit:
            assert not self.ready, "a consumer has credit but messages wait"
        if self.max_length is not None:
            assert len(self.ready) <= self.max_length


QueueMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_queue_against_model = QueueMachine.TestCase


# ---------------------------------------------------------------------- TTL

SLACK = 1e-5


class TTLMachine(RuleBasedStateMachine):
    """Message TTL at the head, driven like a real driver drives timers.

    Checked: no message is handed out after its deadline (except at once, to a
    consumer that can take it, when published with TTL 0); a message is only
    dropped at the head and only after its deadline; the TTL timer is always
    pending for exactly the head's deadline; when a step ends the head is not
    past its deadline (beyond the timer's slack)."""

    @initialize(ttl=st.sampled_from([None, 0, 300, 1000]))
    def setup(self, ttl):
        self.ttl = None if ttl is None else ttl / 1000
        self.q = AMQQueue(
            "q",
            BackingQueue(None, durable=False),
            durable=False,
            arguments={} if ttl is None else {"x-message-ttl": ttl},
        )
        self.now = 0.0
        self.timer_at = None
        self.deadline: dict[int, float | None] = {}
        self.ready: list[int] = []
        self.n = 0
        self.consuming = False

    def _run(self, acts, fresh=()):
        for a in acts:
            if isinstance(a, SetTimer) and a.key == TTL_TIMER:
                self.timer_at = self.now + a.delay
            elif isinstance(a, CancelTimer) and a.key == TTL_TIMER:
                self.timer_at = None
            elif isinstance(a, Emit):
                e = a.event
                if isinstance(e, PublishAccepted):
                    self.ready.append(e.offset)
                    self.deadline[e.offset] = self.pending[e.publish_id]
                elif isinstance(e, (Deliver, GetOk)):
                    assert self.ready and self.ready[0] == e.offset, "not the head"
                    self.ready.pop(0)
                    d = self.deadline[e.offset]
                    if d is not None and d <= self.now:
                        assert e.offset in fresh and isinstance(e, Deliver), f"expired message {e.offset} handed out"
                elif isinstance(e, MessagesDropped):
                    assert e.reason == "expired"
                    for o in e.offsets:
                        assert self.ready and self.ready[0] == o, "dropped a message that is not the head"
                        self.ready.pop(0)
                        d = self.deadline[o]
                        assert d is not None and d <= self.now, f"dropped {o} before its deadline"

    @rule(exp=st.sampled_from([None, "0", "200", "700", "5000"]), k=st.integers(1, 3))
    def publish(self, exp, k):
        items, self.pending = [], {}
        for _ in range(k):
            self.n += 1
            ttls = [t for t in (self.ttl, None if exp is None else int(exp) / 1000) if t is not None]
            self.pending[self.n] = self.now + min(ttls) if ttls else None
            items.append(Publish(CHANNELS[0], self.n, f"m{self.n}", b"x", {} if exp is None else {"expiration": exp}))
        before = set(self.ready)
        acts = self.q.publish_many(self.now, items)
        fresh = {a.event.offset for a in acts if isinstance(a, Emit) and isinstance(a.event, PublishAccepted)}
        assert not (fresh & before)
        self._run(acts, fresh)

    @rule(dt=st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0, 3.0]))
    def advance(self, dt):
        end = self.now + dt
        fired = 0
        while self.timer_at is not None and self.timer_at <= end:
            fired += 1
            assert fired < 100, "the TTL timer keeps firing without progress"
            self.now = max(self.now, self.timer_at)
            self.timer_at = None
            self._run(self.q.timer(self.now, TTL_TIMER))
        self.now = end

    @rule()
    def get(self):
        self._run(self.q.get(self.now, CHANNELS[1], 0, no_ack=True))

    @rule()
    def toggle_consumer(self):
        if self.consuming:
            self._run(self.q.cancel(self.now, CHANNELS[0], "t"))
        else:
            self._run(self.q.consume(self.now, CHANNELS[0], "t", no_ack=True))
        self.consuming = not self.consuming

    @invariant()
    def timer_tracks_the_head(self):
        if not hasattr(self, "q"):
            return
        assert self.q.bq.ready_offsets() == self.ready
        head = self.deadline[self.ready[0]] if self.ready else None
        if head is None:
            assert self.timer_at is None
        else:
            assert self.timer_at is not None and abs(self.timer_at - head) < SLACK
            assert head > self.now - SLACK, "the head outlived its deadline"


TTLMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_ttl_against_model = TTLMachine.TestCase

"""``GET /metrics``: Prometheus' text format from one snapshot of the node.

A scrape reads :meth:`~mirrorq.mgmt.source.NodeSource.metrics_snapshot`
(this node's view, registry, memory and the queues whose master is here)
and renders it with prometheus_client through a collector that yields that
snapshot's families -- nothing is kept between scrapes; counters are the
masters' own totals.  Names follow rabbitmq_prometheus where it has one,
``mirrorq_`` otherwise:

=============================================  =====================================================
rabbitmq_queue_messages_ready / _unacked       gauges {vhost, queue}
rabbitmq_queue_messages / rabbitmq_queue_consumers
rabbitmq_queue_messages_published_total        counters {vhost, queue} since the master took
rabbitmq_queue_messages_delivered_total        over (a failover resets them, as a counter reset)
rabbitmq_queue_messages_acked_total
rabbitmq_queue_messages_confirmed_total
mirrorq_queue_confirm_latency_seconds          histogram {vhost, queue}: the replication part of
                                               a confirm (broadcast turn to GM round complete)
mirrorq_queue_gm_ring_size                     members of the queue's GM view {vhost, queue}
mirrorq_queue_gm_view_version                  version of that view (gm_group row)
mirrorq_queue_mirrors / _mirrors_synchronised  mirrors in the record / synchronised ones
mirrorq_queue_mirror_lag                       broadcasts not yet held by every mirror
mirrorq_queue_sync_progress_ratio              {vhost, queue, mirror}: a running sync, 0..1
mirrorq_queue_sync_records_sent_total          records sent by syncs
mirrorq_node_up                                {node}: 1 up, 0 down, as this node sees it
rabbitmq_raft_term_total                       the registry's Raft term {raft_cluster="registry"}
rabbitmq_raft_log_commit_index / _last_applied_index
mirrorq_raft_is_leader                         1 if this node leads the registry
rabbitmq_process_resident_memory_bytes         RSS of the node's whole process group
rabbitmq_resident_memory_limit_bytes           the memory alarm's limit (vm_memory_high_watermark)
rabbitmq_disk_space_available_bytes            free space of the data dir's file system
rabbitmq_disk_space_available_limit_bytes      the disk alarm's limit (disk_free_limit)
rabbitmq_alarms_memory_used_watermark          1 while this node's memory alarm is raised
rabbitmq_alarms_free_disk_space_watermark      1 while this node's disk alarm is raised
rabbitmq_identity_info                         {rabbitmq_node, rabbitmq_cluster}
=============================================  =====================================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from mirrorq.admin.session import node_of_member
from mirrorq.mgmt.shapes import sync_fraction

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
QL = ["vhost", "queue"]
_COUNTERS = (
    ("publish", "rabbitmq_queue_messages_published", "Messages published into the queue"),
    ("deliver_get", "rabbitmq_queue_messages_delivered", "Messages delivered to consumers or got"),
    ("ack", "rabbitmq_queue_messages_acked", "Messages acknowledged by consumers"),
    ("confirm", "rabbitmq_queue_messages_confirmed", "Publishes confirmed to publishers"),
)


class SnapshotCollector:
    def __init__(self, snap: dict) -> None:
        self.snap = snap

    def collect(self):
        snap = self.snap
        node = snap["node"]
        ident = GaugeMetricFamily(
            "rabbitmq_identity_info",
            "The node and cluster this endpoint describes",
            labels=["rabbitmq_node", "rabbitmq_cluster"],
        )
        ident.add_metric([node, "mirrorq"], 1)
        yield ident
        yield from self._queues(snap["queues"])
        up = GaugeMetricFamily(
            "mirrorq_node_up", "1 if the node is up as this node sees it, 0 if down", labels=["node"]
        )
        for n, v in sorted(snap["view"].items()):
            up.add_metric([n], 1 if n == node or v.get("state") == "up" else 0)
        if node not in snap["view"]:
            up.add_metric([node], 1)
        yield up
        reg = snap["registry"]
        rl = ["raft_cluster"]
        for name, key, help_, fam in (
            ("rabbitmq_raft_term", "term", "Current Raft term of the registry", CounterMetricFamily),
            ("rabbitmq_raft_log_commit_index", "commit_index", "Registry Raft commit index", GaugeMetricFamily),
            (
                "rabbitmq_raft_log_last_applied_index",
                "applied_index",
                "Registry Raft last applied index",
                GaugeMetricFamily,
            ),
        ):
            if isinstance(reg.get(key), int):
                m = fam(name, help_, labels=rl)
                m.add_metric(["registry"], reg[key])
                yield m
        lead = GaugeMetricFamily("mirrorq_raft_is_leader", "1 if this node leads the registry's Raft group", labels=rl)
        lead.add_metric(["registry"], 1 if reg.get("leader") == node else 0)
        yield lead
        mem = GaugeMetricFamily(
            "rabbitmq_process_resident_memory_bytes",
            "Resident memory of the node's process group (every actor process)",
        )
        mem.add_metric([], snap.get("rss") or 0)
        yield mem
        yield from self._alarms(snap.get("alarms") or {})

    @staticmethod
    def _alarms(a: dict):
        for name, key, help_ in (
            ("rabbitmq_resident_memory_limit_bytes", "mem_limit", "Memory high watermark in bytes"),
            ("rabbitmq_disk_space_available_bytes", "disk_free", "Disk space available in bytes"),
            ("rabbitmq_disk_space_available_limit_bytes", "disk_free_limit", "Free disk space low watermark in bytes"),
            ("rabbitmq_alarms_memory_used_watermark", "mem_alarm", "is 1 if VM memory watermark alarm is in effect"),
            (
                "rabbitmq_alarms_free_disk_space_watermark",
                "disk_free_alarm",
                "is 1 if free disk space watermark alarm is in effect",
            ),
        ):
            if a.get(key) is not None:
                m = GaugeMetricFamily(name, help_)
                m.add_metric([], int(a[key]))
                yield m

    def _queues(self, queues: list[dict]):
        g = {
            k: GaugeMetricFamily(n, h, labels=QL)
            for k, n, h in (
                ("messages_ready", "rabbitmq_queue_messages_ready", "Messages ready to be delivered"),
                (
                    "messages_unacknowledged",
                    "rabbitmq_queue_messages_unacked",
                    "Messages delivered, not yet acknowledged",
                ),
                ("messages", "rabbitmq_queue_messages", "Messages ready and unacknowledged"),
                ("consumers", "rabbitmq_queue_consumers", "Consumers of the queue"),
                ("mirror_lag", "mirrorq_queue_mirror_lag", "GM broadcasts of the master not yet held by every mirror"),
            )
        }
        c = {k: CounterMetricFamily(n, h, labels=QL) for k, n, h in _COUNTERS}
        ring = GaugeMetricFamily("mirrorq_queue_gm_ring_size", "Members of the queue's GM view", labels=QL)
        version = GaugeMetricFamily("mirrorq_queue_gm_view_version", "Version of the queue's GM view", labels=QL)
        mirrors = GaugeMetricFamily("mirrorq_queue_mirrors", "Mirrors of the queue (its record)", labels=QL)
        synced = GaugeMetricFamily("mirrorq_queue_mirrors_synchronised", "Synchronised mirrors", labels=QL)
        progress = GaugeMetricFamily(
            "mirrorq_queue_sync_progress_ratio", "A running sync's progress (0..1)", labels=QL + ["mirror"]
        )
        sent = CounterMetricFamily("mirrorq_queue_sync_records_sent", "Records sent by the master's syncs", labels=QL)
        latency = HistogramMetricFamily(
            "mirrorq_queue_confirm_latency_seconds",
            "Replication latency of publisher confirms at the master",
            labels=QL,
        )
        for q in queues:
            lv = [q["vhost"], q["name"]]
            rec, info, group = q["record"], q["info"], q["group"]
            if group is not None:
                ring.add_metric(lv, len(group.get("members") or ()))
                version.add_metric(lv, group.get("version") or 0)
            mirrors.add_metric(lv, len(rec.get("slave_pids") or ()))
            synced.add_metric(lv, len(rec.get("sync_slave_pids") or ()))
            if info is None:
                continue  # the master did not answer: no live figures this scrape
            for k, fam in g.items():
                if isinstance(info.get(k), int):
                    fam.add_metric(lv, info[k])
            stats = info.get("message_stats") or {}
            for k, counter in c.items():
                counter.add_metric(lv, stats.get(k, 0))
            sent.add_metric(lv, info.get("sync_records_sent") or 0)
            for member, p in sorted((info.get("sync_progress") or {}).items()):
                fraction = sync_fraction(p)
                assert fraction is not None  # a running transfer's entry is never empty (Coordinator.sync_progress)
                progress.add_metric(lv + [node_of_member(member) or member], fraction)
            h = info.get("confirm_latency")
            if h:
                cum, buckets = 0, []
                for le, n in zip([*map(str, h["buckets"]), "+Inf"], h["counts"]):
                    cum += n
                    buckets.append((le, cum))
                latency.add_metric(lv, buckets, h["sum"])
        yield from g.values()
        yield from c.values()
        yield from (ring, version, mirrors, synced, progress, sent, latency)


def render(snap: dict) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snap))
    return generate_latest(registry)

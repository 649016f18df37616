"""deploy/grafana/mirrorq-overview.json and deploy/prometheus.yml (issue #35):
every metric the dashboard's queries name is one GET /metrics exports (the
names of a full snapshot rendered by mirrorq.mgmt.metrics, parsed back), the
dashboard charts what it says it does, and the scrape config targets the
demo nodes' /metrics on their default management ports."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_mgmt_app import SNAPSHOT

from mirrorq.mgmt import metrics
from mirrorq.node.config import DEFAULT_AMQP_PORT, default_management_port

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "mirrorq-overview.json"
#: PromQL words that are not metric names
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}


def exported_names() -> set[str]:
    """Every sample name /metrics gives for a snapshot with every family in it (alarms too)."""
    snap = copy.deepcopy(SNAPSHOT)
    snap["alarms"] = {
        "mem_limit": 10,
        "disk_free": 20,
        "disk_free_limit": 5,
        "mem_alarm": False,
        "disk_free_alarm": True,
    }
    text = metrics.render(snap).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings,
    label matchers, ranges, Grafana variables, label lists of by/on/group_left...
    function names, keywords and numbers are taken out."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\$\{?\w+\}?", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", e):
        if m.group(2) or m.group(1) in KEYWORDS:
            continue  # a function call, a keyword
        names.add(m.group(1))
    return names


def test_the_extractor_finds_names_not_labels_or_functions():
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="1}"}[$__rate_interval]) '
        '* on(instance) group_left(rabbitmq_node) b{rabbitmq_node=~"$node"})) + c offset 5m'
    )
    assert metric_names(expr) == {"a_bucket", "b", "c"}


def _targets(panels: list[dict]):
    for p in panels:
        yield from p.get("targets", [])
        yield from _targets(p.get("panels", []))


def test_every_metric_the_dashboard_queries_is_exported():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for t in _targets(dash["panels"])]
    assert len(exprs) >= 20
    queried = set().union(*map(metric_names, exprs))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"])
            assert m, var
            queried.add(m.group(1))
    exported = exported_names()
    assert queried - exported == set(), f"the dashboard queries metrics /metrics does not export: {queried - exported}"
    # what the dashboard is for: rates, depth, nodes, alarms, Raft, memory, mirroring
    for name in (
        "rabbitmq_queue_messages_published_total",
        "rabbitmq_queue_messages_delivered_total",
        "rabbitmq_queue_messages_acked_total",
        "rabbitmq_queue_messages_ready",
        "rabbitmq_queue_messages_unacked",
        "mirrorq_node_up",
        "rabbitmq_alarms_memory_used_watermark",
        "rabbitmq_alarms_free_disk_space_watermark",
        "rabbitmq_raft_term_total",
        "mirrorq_raft_is_leader",
        "rabbitmq_process_resident_memory_bytes",
        "mirrorq_queue_mirror_lag",
        "mirrorq_queue_confirm_latency_seconds_bucket",
    ):
        assert name in queried, name


def test_the_dashboard_is_a_grafana_dashboard():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "mirrorq-overview" and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}" and t["refId"]
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]


def test_the_scrape_config_targets_every_demo_nodes_metrics():
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job.get("scheme", "http") == "http"
    (static,) = job["static_configs"]
    ports = [default_management_port(DEFAULT_AMQP_PORT + i) for i in range(3)]
    assert static["targets"] == [f"127.0.0.1:{p}" for p in ports]
    # Prometheus refuses a scrape timeout longer than the interval
    assert int(job["scrape_timeout"].rstrip("s")) <= int(cfg["global"]["scrape_interval"].rstrip("s"))

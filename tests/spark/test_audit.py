"""mirrorctl audit on synthetic histories: planted anomalies are flagged by
name and value; a clean history is valid.  (The real kill-test history is
audited in test_spark_stream.py, beside its cluster.)"""

from __future__ import annotations

import json

import pytest
from spark_support import spark  # noqa: F401  (fixture)

pytestmark = pytest.mark.spark


def test_audit_flags_planted_lost_duplicate_reorder(spark, tmp_path):
    from mirrorq.spark import audit

    path = str(tmp_path / "h.jsonl")
    planted = audit.synthesize(path, 30_000, plant=("lost", "duplicate", "reorder"))
    res = audit.run(spark, [path], [])
    assert not res.valid
    c = res.counts
    assert (c["lost"], c["duplicated"], c["reordered"], c["unexpected"]) == (1, 1, 1, 0), c
    assert res.examples["lost"] == [planted["lost"]]
    assert res.examples["duplicated"] == [(planted["duplicate"], 2)]
    assert res.examples["reordered"][0][1] == "p1"
    text = audit.report(res, str(tmp_path / "report.md"))
    assert "INVALID" in text and planted["lost"] in text


def test_audit_clean_history_is_valid_and_cli_writes_report_and_png(spark, tmp_path, capsys):
    from ctl.mirrorctl import main
    from mirrorq.spark import audit

    path = str(tmp_path / "h.jsonl")
    audit.synthesize(path, 9_000, plant=())
    res = audit.run(spark, [path], [])
    assert res.valid and res.counts["lost"] == res.counts["duplicated"] == res.counts["reordered"] == 0
    assert res.counts["publish_ok"] == res.counts["consumed_distinct"] == 3000
    out = tmp_path / "out"
    capsys.readouterr()
    rc = main(["audit", "--no-node-logs", "--history", path, "--out", str(out), "--master", "local[2]"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 0 and json.loads(line)["valid"] is True
    assert (out / "report.md").read_text().startswith("# mirrorq audit")
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

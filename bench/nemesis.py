"""A nemesis run on a real local 3-node cluster (issue #16): kills, stops,
restarts, pauses and partitions (silent drop and TCP reset) while pika
publishers (confirms) and consumers (one ack per message) run; prints a table
and one JSON line, and exits 1 if the checker found a violation.

    flock /tmp/mirrorq-heavy.lock .venv/bin/python bench/nemesis.py --minutes 30 [--seed S]
    .venv/bin/python bench/nemesis.py --acceptance --seed 7       # the CI test's schedule
    .venv/bin/python bench/nemesis.py --steps kill:master:5:5,partition-drop:mirror:8:6

The cluster lives in a fresh directory under --data-dir (default: a temp
dir), kept afterwards with its history.jsonl and node logs; every node is
stopped and every iptables rule and cgroup removed at the end, also on
failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ctl.nemesis import schedule  # noqa: E402
from ctl.nemesis.runner import RunConfig, Runner  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="length of the fault schedule")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--acceptance", action="store_true", help="issue #16's acceptance schedule (seeded)")
    ap.add_argument(
        "--long",
        action="store_true",
        help="the partitions issue's long faults: cuts of 60-90 s, pauses of 30-60 s, flapping",
    )
    ap.add_argument("--steps", default=None, help="explicit steps fault:target:hold:quiet,...")
    ap.add_argument("--faults", default=",".join(schedule.FAULTS))
    ap.add_argument("--publishers", type=int, default=1)
    ap.add_argument("--consumers", type=int, default=1)
    ap.add_argument("--rate", type=float, default=0.0, help="messages/s per publisher (0: as fast as confirms)")
    ap.add_argument("--bound", type=float, default=30.0)
    ap.add_argument("--data-dir", default=None)
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else int(time.time()) % 100000
    if a.steps:
        steps = schedule.parse(a.steps)
    elif a.acceptance:
        steps = schedule.acceptance_schedule(seed)
    elif a.long:
        steps = schedule.long_schedule(seed, a.minutes * 60)
    else:
        steps = schedule.random_schedule(seed, a.minutes * 60, tuple(a.faults.split(",")))
    root = Path(a.data_dir or tempfile.mkdtemp(prefix="mirrorq-nemesis-"))
    root.mkdir(parents=True, exist_ok=True)
    d = root / f"run-{seed}-{int(time.time())}"
    print(f"seed {seed}, {len(steps)} steps, data dir {d}", flush=True)
    t0 = time.monotonic()
    res = Runner(
        RunConfig(
            data_dir=d,
            steps=steps,
            seed=seed,
            publishers=a.publishers,
            consumers=a.consumers,
            rate=a.rate,
            bound=a.bound,
        )
    ).run()
    r = res.report
    kinds = Counter(f for f, _, _ in res.faults)
    restores = [t for _, t in res.restore_times if t is not None]
    rows = [
        ("faults", ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "none"),
        ("run time", f"{time.monotonic() - t0:.0f} s"),
        ("attempted / confirmed", f"{r.attempted} / {r.confirmed}"),
        ("nacked / indeterminate", f"{r.failed} / {r.indeterminate}"),
        ("consumed (distinct) / deliveries", f"{r.consumed} / {r.deliveries}"),
        ("LOST (confirmed)", len(r.lost)),
        ("UNEXPECTED", len(r.unexpected)),
        ("STUCK (in the broker, never delivered)", r.stuck),
        ("UNANSWERED within bound", len(r.unanswered)),
        ("duplicates", len(r.duplicates)),
        ("recovered (indeterminate, consumed)", r.recovered),
        ("longest stall without a confirm", f"{r.longest_stall:.1f} s"),
        (
            "publish latency p50 / p99 / max",
            f"{r.latency.get('p50', 0):.3f} / {r.latency.get('p99', 0):.3f} / {r.latency.get('max', 0):.3f} s",
        ),
        (
            "replicas restored after a step (of steps)",
            f"{len(restores)} of {len(res.restore_times)}; max {max(restores, default=0):.1f} s",
        ),
        ("replicas restored after final heal", "NO" if res.final_restore is None else f"{res.final_restore:.1f} s"),
        (
            "control plane on the majority (ops, slowest)",
            ", ".join(f"{k} {v['n']} max {v['max']:.2f} s" for k, v in sorted(r.control.items())) or "none",
        ),
        ("CONTROL-PLANE ops failed or over the bound", len(r.control_slow)),
        ("TWO MASTERS at once", len(r.two_masters)),
        ("cut node paused after (s, each cut)", " ".join("-" if x is None else f"{x:.1f}" for x in res.step_down)),
        ("cut node serving again after the heal (s)", " ".join("-" if x is None else f"{x:.1f}" for x in res.heal)),
        ("final queue state", json.dumps(res.final_state)),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    for p in res.problems():
        print("VIOLATION:", p)
    for e in res.errors[:10]:
        print("client error:", e)
    print(
        json.dumps(
            {
                "seed": seed,
                "steps": [s.__dict__ for s in steps],
                "faults": res.faults,
                "restore_times": res.restore_times,
                "final_restore": res.final_restore,
                "step_down": res.step_down,
                "heal": res.heal,
                "report": r.to_dict(),
                "history": res.history_path,
            },
            default=str,
        )
    )
    return 0 if res.valid else 1


if __name__ == "__main__":
    sys.exit(main())

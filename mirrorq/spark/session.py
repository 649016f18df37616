"""A SparkSession for mirrorq's tools and tests: loopback only, no UI, the venv's python.

With a cluster master (``spark://...``) the executors get the driver's
``PYTHONPATH`` (a checkout's mirrorq, not another install's), unless
``conf`` sets ``spark.executorEnv.PYTHONPATH``.

``PYSPARK_PYTHON`` is set to ``sys.executable`` as it is (the venv's
``bin/python``), never the symlink resolved: the resolved interpreter
would not see the venv's packages (pyarrow, mirrorq) in Spark's Python
workers.  ``SPARK_LOCAL_IP`` is 127.0.0.1 and the driver binds loopback.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def spark_env() -> None:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def session(app: str = "mirrorq", master: str = "local[2]", conf: dict | None = None) -> Any:
    spark_env()
    from pyspark.sql import SparkSession

    b = (
        SparkSession.builder.appName(app)
        .master(master)
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.python.daemon.module", os.environ.get("MIRRORQ_SPARK_DAEMON", "mirrorq.spark.daemon"))
    )
    if not master.startswith("local") and os.environ.get("PYTHONPATH"):
        # executors of a cluster import mirrorq (the source, the daemon) from where the driver does
        b = b.config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
    for k, v in (conf or {}).items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    from mirrorq.spark.source import register

    register(spark)
    return spark

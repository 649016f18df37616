"""Spark's Python daemon for mirrorq's sessions: ``pyspark.daemon`` with the installed pyspark ahead of ``pyspark.zip``.

Spark starts its Python workers as ``python -m <daemon module> <worker
module>`` with ``PYTHONPATH`` = ``$SPARK_HOME/python/lib/pyspark.zip`` and
the py4j zip first.  Modules imported from a zip are compiled from source
in every process that imports them (nothing caches the bytecode), and
the daemon imports the worker module *after* each fork (pyspark.daemon:
no threads before a fork, and pyarrow starts threads), so every worker it
forks -- the data source's planning calls (create, plan a read) and each
task's worker -- pays about two seconds of compiling pyspark before it
runs a line of ours.

:func:`prefer_installed` moves the zips behind the rest of ``sys.path``
when the same pyspark (and py4j) is installed in the interpreter's
site-packages, as a ``pip install pyspark`` is: the zip is that
package's own copy, so the modules are the same and their compiled
``.pyc`` files are used.  When versions differ (a separate Spark
distribution), nothing is moved.  The daemon is then pyspark's own
(:func:`pyspark.daemon.manager`), unchanged.

Used by :func:`mirrorq.spark.session.session` as
``spark.python.daemon.module``; any session can set it the same way
(``--conf spark.python.daemon.module=mirrorq.spark.daemon``) when mirrorq
is importable on the workers.
"""

from __future__ import annotations

import os
import re
import sys
import zipfile

VERSION_RE = re.compile(r"""__version__\s*(?::\s*str\s*)?=\s*["']([^"']+)["']""")


def _zip_version(path: str, member: str) -> str | None:
    try:
        with zipfile.ZipFile(path) as z:
            text = z.read(member).decode("utf-8", "replace")
    except (OSError, KeyError, zipfile.BadZipFile):
        return None
    m = VERSION_RE.search(text)
    return m.group(1) if m else None


def _installed_version(paths: list[str], member: str) -> str | None:
    for p in paths:
        f = os.path.join(p, member)
        if os.path.isfile(f):
            try:
                with open(f, encoding="utf-8") as fh:
                    m = VERSION_RE.search(fh.read())
            except OSError:
                return None
            return m.group(1) if m else None
    return None


def prefer_installed(path: list[str]) -> list[str]:
    """``path`` with Spark's pyspark / py4j zips moved to its end when the
    same versions are installed in one of its directories."""
    others = [p for p in path if not p.endswith(".zip")]
    moved: list[str] = []
    for p in path:
        name = os.path.basename(p)
        if name == "pyspark.zip":
            member = "pyspark/version.py"
        elif name.startswith("py4j-") and name.endswith("-src.zip"):
            member = "py4j/version.py"
        else:
            continue
        zv = _zip_version(p, member)
        if zv is not None and zv == _installed_version(others, member):
            moved.append(p)
    if not moved:
        return list(path)
    return [p for p in path if p not in moved] + moved


def main() -> None:
    sys.path[:] = prefer_installed(sys.path)
    from pyspark import daemon

    daemon.manager()


if __name__ == "__main__":
    main()

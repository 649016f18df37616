"""A tool's session with one running node (mirrorctl, the ring view).

:class:`NodeSession` talks to one node's agent (registry reads and
transactions, membership view), its queue manager (commands to queue
masters) and its AMQP front end (connections).  Every call has a deadline
(``mirrorctl --timeout``); within it:

* a linearizable registry read that the node answers "retry" (a Raft leader
  change: the read was not served) or does not answer at all (its answer was
  lost with the old leader) is asked again -- through a fresh client, so a
  late answer to the first ask can never be taken for the next one's -- so
  an idle cluster electing a leader never fails a listing;
* a registry transaction refused before it was proposed (no leader, not the
  leader, lost to a leader change: definitely not committed) is submitted
  again; one of unknown outcome is reported, never repeated.

Running out of time is :class:`~mirrorq.admin.cluster.CommandTimeout` (exit 75); a
node that cannot be reached :class:`~mirrorq.admin.cluster.NodeUnavailable` (69).
"""

from __future__ import annotations

import time
from typing import Any

from mirrorq.admin.cluster import Cluster, ClusterError, CommandTimeout, NodeUnavailable

#: default deadline of a command's registry work (seconds; ``--timeout`` overrides)
DEFAULT_TIMEOUT = 30.0
#: one ask's wait before it is asked again through a fresh client
ATTEMPT = 3.0
#: a node's status ask when a session opens (the agent answers it locally)
STATUS_TIMEOUT = 1.5
#: pause between two asks answered "retry" (a leader is being elected)
RETRY_PAUSE = 0.05


def node_of_member(member: Any) -> str | None:
    """The node of a GM member name (``node/host:port/uid``), None if not one."""
    from mirrorq.policy.converge import node_of

    try:
        return node_of(member)
    except ValueError:
        return None


def live_infos(session: Any, records: list[dict], up: set[str], timeout: float) -> dict:
    """``info`` of every queue whose master's node is up: (vhost, name) -> result."""
    ask = [(r["vhost"], r["name"]) for r in records if node_of_member(r.get("pid")) in up]
    return {(res["vhost"], res["name"]): res for res in session.queue_ops("info", ask, timeout=timeout)} if ask else {}


def _retryable_txn_error(error: str) -> bool:
    """Refused before it was proposed, or lost to a leader change: not committed."""
    return "retry" in error and "unknown outcome" not in error and "outcome unknown" not in error


class NodeSession:
    """A connection to one running node: its name, admin port (and host),
    and its AMQP shell (which actor class fronts its AMQP port).  A tool's
    is short-lived (:func:`open_session`); the management server keeps
    one per node (:mod:`mirrorq.mgmt.source`)."""

    def __init__(
        self,
        node: str,
        admin_port: int,
        amqp_shell: str = "watch",
        timeout: float | None = None,
        host: str = "127.0.0.1",
    ):
        from mirrorq.node.client import NodeClient, NodeUnreachable

        self.node = node
        self.host = host
        self.admin_port = int(admin_port)
        self.amqp_shell = amqp_shell
        self.timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        try:
            self.client = NodeClient(self.admin_port, host)
        except NodeUnreachable as e:
            raise NodeUnavailable(f"node {node} is not reachable: {e}") from None
        self._manager = None
        self._listener = None

    # ---- plumbing --------------------------------------------------------------------
    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else float(timeout))

    def _fresh_client(self) -> None:
        from mirrorq.node.client import NodeClient, NodeUnreachable

        self.client.close()
        self._manager = self._listener = None
        try:
            self.client = NodeClient(self.admin_port, self.host)
        except NodeUnreachable as e:
            raise NodeUnavailable(f"node {self.node} is not reachable: {e}") from None

    def _ask_until(self, deadline: float, make_msg, answered, what: str, resend_unanswered: bool = True):
        """Ask the agent ``make_msg()`` until ``answered(reply)`` returns a
        result (not None) or the deadline passes.  An ask left unanswered is
        asked again (through a fresh client) only if ``resend_unanswered``."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommandTimeout(f"node {self.node} did not complete {what} in time (--timeout)")
            res = self.client.ask(make_msg(), min(ATTEMPT, left) if resend_unanswered else left)
            if res is None:
                if not resend_unanswered:
                    raise CommandTimeout(
                        f"node {self.node} did not answer {what} within the timeout; its outcome is unknown"
                    )
                self._fresh_client()
                continue
            out = answered(res)
            if out is not None:
                return out
            time.sleep(min(RETRY_PAUSE, max(0.0, deadline - time.monotonic())))

    # ---- the registry ------------------------------------------------------------------
    def txn(self, txn: dict, timeout: float | None = None, idempotent: bool = False):
        """Run ``txn``; one refused before it was proposed is submitted again.
        ``idempotent`` (it only puts rows, unconditionally: applying it twice
        is applying it once): one of unknown outcome (the leader changed
        before answering) or unanswered is submitted again too."""
        from mirrorq.node.messages import RegistryResult, RegistryTxn

        def answered(res):
            if not isinstance(res, RegistryResult):
                return None
            if not res.ok and (_retryable_txn_error(res.error) or (idempotent and "retry" in res.error)):
                return None
            return res

        return self._ask_until(
            self._deadline(timeout),
            lambda: RegistryTxn(txn),
            answered,
            "a registry transaction",
            resend_unanswered=idempotent,
        )

    def rows(self, table: str, timeout: float | None = None) -> list[dict]:
        """All rows of ``table``, read linearizably (a list right after a set shows it)."""
        from mirrorq.node.messages import RegistryGet, RegistryRows

        def answered(res):
            if not isinstance(res, RegistryRows):
                return None
            if res.ok:
                return res.rows
            if "retry" in res.error:
                return None
            raise ClusterError(f"reading table {table} on node {self.node} failed: {res.error}")

        return self._ask_until(
            self._deadline(timeout), lambda: RegistryGet(table, linearizable=True), answered, f"a read of table {table}"
        )

    # ---- the node ------------------------------------------------------------------------
    def status(self, timeout: float = 3.0):
        from mirrorq.node.client import NodeUnreachable

        try:
            return self.client.status(timeout)
        except NodeUnreachable as e:
            raise NodeUnavailable(f"node {self.node}: {e}") from None

    def nodes_up(self) -> set[str]:
        st = self.status()
        return {n for n, v in st.view.items() if v.get("state") == "up"}

    def queue_ops(
        self, command: str, queues: list[tuple[str, str]], args: dict | None = None, timeout: float = 5.0
    ) -> list[dict]:
        from mirrorq.queues.manager import QueueOps, QueueOpsResult

        res = self.client.asys.ask(
            self._queue_manager(), QueueOps(command, tuple(queues), dict(args or {}), timeout), timeout + 3.0
        )
        if not isinstance(res, QueueOpsResult):
            raise CommandTimeout(
                f"the queue manager on node {self.node} did not answer {command!r} within {timeout + 3:g}s"
            )
        return res.results

    def quorum_members(self, action: str, vhost: str, name: str, node: str = "", timeout: float = 30.0):
        """``status`` / ``add`` / ``delete`` a member of a quorum queue through
        the node's queue manager; answers a QuorumMembersResult."""
        from mirrorq.queues.manager import QuorumMembers, QuorumMembersResult

        res = self.client.asys.ask(
            self._queue_manager(), QuorumMembers(action, vhost, name, node, timeout), timeout + 3.0
        )
        if not isinstance(res, QuorumMembersResult):
            raise CommandTimeout(
                f"the queue manager on node {self.node} did not answer {action!r} of a member "
                f"of queue '{name}' within {timeout + 3:g}s"
            )
        return res

    def declare(self, spec: dict, timeout: float = 10.0):
        """Declare a queue through the node's queue manager (as the AMQP front
        end does): ``spec`` has name, vhost, durable, auto_delete,
        exclusive_owner, arguments; answers a DeclareResult."""
        from mirrorq.queues.manager import DeclareQueue, DeclareResult

        res = self.client.asys.ask(self._queue_manager(), DeclareQueue(dict(spec)), timeout)
        if not isinstance(res, DeclareResult):
            raise CommandTimeout(f"the queue manager on node {self.node} did not answer a declare within {timeout:g}s")
        return res

    def _queue_manager(self):
        from mirrorq.queues.manager import MANAGER_GLOBAL_NAME

        if self._manager is None:
            self._manager = self.client.asys.createActor(
                "mirrorq.queues.manager.QueueManager", globalName=MANAGER_GLOBAL_NAME
            )
        return self._manager

    def front_end(self, what: str, target: str = "", reason: str = "", timeout: float = 5.0):
        """Ask the node's AMQP front end (:class:`~mirrorq.amqp.frontend.FrontEndQuery`)."""
        from mirrorq.amqp.frontend import FrontEndAnswer, FrontEndQuery
        from mirrorq.amqp.listener import LISTENER_GLOBAL_NAME

        if self._listener is None:
            cls = {"asyncio": "mirrorq.amqp.bridge.AMQPBridge"}.get(
                self.amqp_shell, "mirrorq.amqp.listener.AMQPListener"
            )
            self._listener = self.client.asys.createActor(cls, globalName=LISTENER_GLOBAL_NAME)
        res = self.client.asys.ask(self._listener, FrontEndQuery(what, target, reason), timeout)
        if not isinstance(res, FrontEndAnswer):
            raise CommandTimeout(f"the AMQP front end of node {self.node} did not answer within {timeout:g}s")
        return res

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> NodeSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_session(cluster: Cluster, node: str | None, timeout: float | None = None) -> NodeSession:
    """A session with ``node``, else with the first running node not paused
    in a minority, in :meth:`Cluster.session_order` (the addressed node
    first for a remote cluster)."""
    if node:
        cluster.config_path(node)
        candidates = [node]
    else:
        candidates = cluster.session_order()
    paused = ""
    for n in candidates:
        if not cluster.is_running(n):
            continue
        try:
            info = cluster.pid_info(n) or {}
            if "admin_port" not in info:
                continue
            host, port = cluster.admin_address(n)
            session = NodeSession(n, port, cluster.config(n).amqp_shell, timeout, host)
        except NodeUnavailable:
            continue
        why = minority_refusal(session)
        if not why:
            return session
        session.close()
        paused = paused or why
    if paused:
        raise NodeUnavailable(paused)
    if node:
        raise NodeUnavailable(f"node {node} is not running")
    raise NodeUnavailable(f"no node of the cluster in {cluster.data_dir} is running")


def minority_refusal(session: NodeSession) -> str:
    """Why a command must not run through ``session``'s node (it is paused in
    a minority: its registry copy may be stale and it cannot commit), or ""."""
    st = session.status(STATUS_TIMEOUT)
    part = getattr(st, "partition", None) or {}
    if not part.get("paused"):
        return ""
    return (
        f"node {session.node} is in a minority and paused (cluster_partition_handling: pause_minority): "
        f"it reaches {', '.join(part.get('sees') or [session.node])} of the cluster "
        f"{', '.join(part.get('cluster') or [])}; ask a node of the majority"
    )

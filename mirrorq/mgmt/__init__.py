"""The HTTP management server of a node: RabbitMQ's management API, /metrics, a live ring page.

One server per node, on the node's ``management_port`` (node config;
default the AMQP port + 10000, RabbitMQ's 15672; 0: none).  It is a process
of the node's process group, started and restarted by an actor of the node:

* :mod:`.supervisor` -- the actor (created by the node daemon after the AMQP
  listener) that starts the server process, restarts it when it dies, and
  stops it with the node; killing the node's process group kills it too;
* :mod:`.server` -- the process: an aiohttp application on the port, its
  access log in ``<data_dir>/mgmt.log``, its life events in ``node.log``;
* :mod:`.source` -- where its data comes from: the admin layer mirrorctl
  uses too (:mod:`mirrorq.admin`: sessions with the node and its peers,
  the listings and the operations), blocking, so the handlers call it through ``asyncio.to_thread``;
* :mod:`.shapes` -- mirrorctl's rows as RabbitMQ's management API objects (pure);
* :mod:`.rates` -- per-second rates of counters between samples;
* :mod:`.auth` -- HTTP basic auth against the registry's users (the AMQP
  login's password check), administrators only;
* :mod:`.api` -- the routes, bodies, status codes and JSON errors;
* :mod:`.metrics` -- ``GET /metrics`` in Prometheus' text format;
* :mod:`.page` -- ``GET /``: every queue's GM ring, live (``static/``).
"""

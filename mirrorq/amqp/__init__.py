"""AMQP 0-9-1 front end: the sans-IO connection core (:mod:`.connection`),
the topology cache and routing (:mod:`.topology`) and the Thespian socket
shell (:mod:`.listener`), so pika, aio-pika and kombu work unchanged."""

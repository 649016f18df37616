"""mirrorq: a clustered message broker whose queues are mirrored the way
RabbitMQ's classic mirrored queues are, built on Thespian."""

__version__ = "0.1.0"

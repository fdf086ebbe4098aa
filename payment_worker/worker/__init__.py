"""The Celery side: the app and its configuration, thin tasks, the drain loop that takes one
account's work through the state machine, queueing, and the sweeper."""

"""What runs inside a worker process, read top-down as the recovery story:
``main`` (the worker's entry, the control client, the spare's wait) ->
``recovery`` (detect, tear down, report, carry out the decision, resume) ->
``generation`` (leave the old one, enter the new one) and ``regroup``
(re-point live objects to the new groups) -> ``rebuild`` (a trainer for a
resized world) -> ``restore`` (put a snapshot back) -> ``hooks`` (the
mirror, recovery and fault points the trainer calls)."""

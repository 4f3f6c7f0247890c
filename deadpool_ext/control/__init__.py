"""The launcher side: processes that start, watch and decide, and never
join a collective. ``launch`` (deadpool-launch) hosts the store and runs the
``coordinator`` on node 0; an ``agent`` per node starts its workers, reports
their exits and obeys kill and stop commands."""

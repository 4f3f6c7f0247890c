"""The job's rules: pure functions of a frozen ``JobView`` that return what
the coordinator then does (no I/O, no torch.distributed; tested without
processes).

- view.py: the view and what it is made of (a look at the heartbeats, the
  news of one step), the ``Wait`` of a decision not yet made;
- effects.py: what a rule asks for (a new generation, a loss, a drain, a
  stop, an event...);
- triggers.py: the ordered rules the coordinator runs at every step;
- decide.py: the recovery policy of a generation that collects reports
  (swap, wait for spares, shrink, checkpoint and stop, grow, drain, stop);
- exits.py, faults.py, stragglers.py, admission.py: what an exit or a stall
  means, a NaN's and a corruption's verdicts, which node is slow, who may
  join and when a decision needs a majority;
- ending.py: what the job's end says (its exit code, the drains left).
"""

"""Planning a --deadpool job before it runs: pure arithmetic, no measurement.

- ``scale``: the memory and bandwidth planner (memory per GPU, snapshot and
  mirror bytes, whether the mirror hides inside an iteration) for the
  paper's models and hardware;
- ``goodput``: the goodput model, closed forms and a discrete-event
  simulation of a long run under failures, per recovery strategy;
- ``slurm``: the layout of a Slurm job under deadpool-launch (ranks per
  node, warm spares, buddies, the #SBATCH header), the sbatch scripts' dry run;
- ``rebuild_cost``: what rebuilding the process groups after a failure costs a
  rank, every group (what recovery does) or only those with a changed member.

The command lines are the thin scripts beside it in tools/ (plan_scale.py,
goodput.py, slurm_plan.py, scale_report.py with scale_rebuild.py); nothing
of deadpool_ext imports it. Nothing here imports torch or megatron, and
nothing of deadpool_ext outside its pure modules, so planning runs on any
machine in a fraction of a second.
"""

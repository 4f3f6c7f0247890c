"""One-off experiments behind a design decision, kept to recheck it on
another torch, NCCL or machine: each module's docstring says what it asks
and which page holds its answer. Nothing of the package, the tests or a
user's workflow runs them.

    python -m tools.probes.NAME --help
"""

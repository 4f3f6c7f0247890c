"""The data plane: the optimizer shard as one self-checking buffer
(``snapshot``), its copy on the buddy (``mirror``), and re-sharding it for
a data-parallel size that changed (``reshard``). Tensors only; no decision
is taken here."""

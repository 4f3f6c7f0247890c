"""Megatron-LM's check of the data-parallel replicas' weights
(megatron/training/replica_check.py): added when its interval is given,
unless an extension checks instead."""

from types import SimpleNamespace

from megatron.training.replica_check import ReplicaHashCheck, replica_check_hooks

from deadpool_ext.rank.sdc import ReplicaDigestCheck


def test_megatron_lms_check_is_added_unless_an_extension_checks_instead():
    config = SimpleNamespace(
        training=SimpleNamespace(check_weight_hash_across_dp_replicas_interval=None)
    )
    assert replica_check_hooks(config, []) == []
    config.training.check_weight_hash_across_dp_replicas_interval = 5
    (hook,) = replica_check_hooks(config, [])
    assert type(hook) is ReplicaHashCheck and hook.interval == 5
    assert replica_check_hooks(config, [ReplicaDigestCheck(1)]) == []

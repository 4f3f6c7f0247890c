"""Megatron-LM's training API, for scripts written against it, run by this package's trainer.

It is what Megatron-LM's ``pretrain_gpt.py`` imports from
``megatron.training`` (``pretrain``, ``get_args``, ``get_timers``,
``get_tokenizer``, ``print_rank_0``, ...). Such a script runs unchanged
under torchrun, and with ``--deadpool`` under deadpool-launch with
recovery: ``pretrain`` hands the run to the installed runner (setup.py's
``megatron.training.runners`` entry point: deadpool_ext/entry.py), or to
this package's trainer where none is installed.

The callbacks keep Megatron-LM's signatures:

- ``model_provider(pre_process=True, post_process=True[, vp_stage=None])``,
  reading the run's settings from ``get_args()`` and
  ``core_transformer_config_from_args``;
- ``train_valid_test_datasets_provider(train_val_test_num_samples[, vp_stage])``,
  called once per process (a warm spare calls it before it knows its place);
  a rank may return None for a split it does not read, as Megatron-LM's
  (``utils.get_batch_on_this_tp_rank`` then gives its tensor-parallel peers
  the batch);
- ``forward_step_func(data_iterator, model)`` -> (output, loss function).

``get_args()`` is Megatron-LM's namespace: every flag under its
destination, and what Megatron-LM derives (``padded_vocab_size``,
``params_dtype``, ``data_parallel_size``, ``add_bias_linear``, ...), kept
up to date when a recovery resizes the job.
"""

import argparse
import contextlib
import dataclasses
import inspect
import sys
import warnings
from importlib.metadata import entry_points

from megatron.training import arguments
from megatron.training.arguments import ConfigError
from megatron.training.config import SECTIONS, Config
from megatron.training.global_vars import (  # noqa: F401 - Megatron-LM's names, from here too
    _Run,
    get_args,
    get_timers,
    get_tokenizer,
)

RUNNERS = "megatron.training.runners"  # the entry-point group of runners


def print_rank_0(message) -> None:
    if _rank() == 0:
        print(message, flush=True)


def is_last_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(message) -> None:
    if is_last_rank():
        print(message, flush=True)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def args_view(config: Config) -> argparse.Namespace:
    """Megatron-LM's namespace of a run: each flag under its destination,
    the script's own flags, and what Megatron-LM derives from them."""
    args = argparse.Namespace()
    for name in SECTIONS:
        args.__dict__.update(dataclasses.asdict(getattr(config, name)))
    for section in config.extensions.values():
        args.__dict__.update(dataclasses.asdict(section))
    args.__dict__.update(config.run.script_args)
    m, t = config.model, config.training
    args.__dict__.update(
        world_size=config.world_size,
        rank=_rank(),
        data_parallel_size=config.data_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        context_parallel_size=1,
        padded_vocab_size=config.run.padded_vocab_size,
        params_dtype=_params_dtype(config),
        add_bias_linear=not m.disable_bias_linear,
        add_position_embedding=m.position_embedding,
        layernorm_epsilon=m.norm_epsilon,
        use_legacy_models=False,
        legacy_tokenizer=False,
        check_for_spiky_loss=False,
        iteration=0,
        consumed_train_samples=0,
        fp16_lm_cross_entropy=False,
        train_iters=t.train_iters,
        cuda_graph_scope=_cuda_graph_scopes(config),
    )
    return args


def _cuda_graph_scopes(config: Config) -> list:
    """--cuda-graph-scope as Megatron-LM's parser gives it: megatron-core's
    CudaGraphScope members ('full', deprecated, stays a string)."""
    from megatron.core.transformer.enums import CudaGraphScope

    return [s if s == "full" else CudaGraphScope[s] for s in config.gpu.cuda_graph_scope]


def _params_dtype(config: Config):
    from megatron.training.model_setup import params_dtype

    return params_dtype(config)


class _ModelProvider:
    """Megatron-LM's ``model_provider(pre_process, post_process, vp_stage)``
    as this package's trainer calls a provider (the run's config first)."""

    def __init__(self, provider):
        self.provider = provider
        self.takes_vp_stage = "vp_stage" in inspect.signature(provider).parameters

    def __call__(self, config, tf_config, pre_process, post_process, vp_stage=None):
        _Run.config, _Run.tf_config = config, tf_config
        _Run.args = args_view(config)
        kwargs = {"vp_stage": vp_stage} if self.takes_vp_stage else {}
        return self.provider(pre_process=pre_process, post_process=post_process, **kwargs)


class _DatasetsProvider:
    """Megatron-LM's ``train_valid_test_datasets_provider``, called with the
    run's numbers of samples (data.build_datasets)."""

    def __init__(self, provider):
        self.provider = provider

    def __call__(self, config: Config, sizes, tokenizer):
        _Run.config, _Run.tokenizer = config, tokenizer
        if _Run.args is None:
            _Run.args = args_view(config)
        with _whole_model_before_groups():
            return self.provider(sizes)


@contextlib.contextmanager
def _whole_model_before_groups():
    """A warm spare builds its datasets before it knows its place, before
    any process group exists: megatron-core's parallel state answers then
    as for a rank that holds the whole model, so a provider that builds
    data only where a rank reads it builds it all (without the builder's
    barriers, which need groups)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        yield
        return
    setters = (
        ps.set_tensor_model_parallel_rank,
        ps.set_tensor_model_parallel_world_size,
        ps.set_pipeline_model_parallel_rank,
        ps.set_pipeline_model_parallel_world_size,
    )
    for setter, value in zip(setters, (0, 1, 0, 1)):
        setter(value)
    try:
        yield
    finally:
        for setter in setters:
            setter(None)


def _runner():
    """The installed runner's module (parse_args, run_training), or None."""
    found = list(entry_points(group=RUNNERS))
    return found[0].load() if found else None


def _parse(runner, args_defaults, extra_args_provider) -> Config:
    parse = runner.parse_args if runner is not None else arguments.parse_args
    defaults = args_defaults or {}
    return parse(sys.argv[1:], defaults=defaults, extra_args_provider=extra_args_provider)


IGNORED = (
    "process_non_loss_data_func",
    "non_loss_data_func",
    "get_embedding_ranks",
    "get_position_embedding_ranks",
    "store",
    "inprocess_call_wrapper",
)


def _check_for_scripts(config: Config) -> None:
    """What a script's own callbacks cannot do here: refused (ConfigError)
    or said. Megatron-LM calls the datasets provider once per virtual
    pipeline stage, this trainer once; the attention the flags choose is
    pretrain_gpt.py's layer spec's, not a script's own."""
    problem = None
    if config.virtual_pipeline_model_parallel_size is not None:
        problem = (
            "virtual pipeline stages with a script's datasets provider are not supported "
            "here (it is called once, without vp_stage): drop "
            "--num-layers-per-virtual-pipeline-stage, or use pretrain_gpt.py"
        )
    if problem:
        raise ConfigError(problem)
    if config.model.attention_backend not in ("auto", "local"):
        warnings.warn(
            f"--attention-backend {config.model.attention_backend} chooses the core attention "
            "of pretrain_gpt.py's layer spec; a script's own spec keeps its attention "
            "(megatron.training.model_setup.with_run_attention gives a spec the chosen one)",
            stacklevel=3,
        )


def pretrain(
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    process_non_loss_data_func=None,
    extra_args_provider=None,
    args_defaults=None,
    **options,
) -> None:
    """Megatron-LM's entry point: parse the flags (with the script's
    defaults and its own flags), build, train, save. It is the script's
    main, and ends the process as Megatron-LM's does: bad flags with exit
    code 2 and a line saying what to change, a failed run with its code."""
    from megatron.core.enums import ModelType

    if model_type != ModelType.encoder_or_decoder:
        raise ConfigError(f"pretrain(): model_type {model_type} is not supported (GPT models only)")
    unknown = set(options) - set(IGNORED)
    if unknown:
        raise TypeError(f"pretrain() got unexpected keyword arguments {sorted(unknown)}")
    given = [n for n in IGNORED if options.get(n) is not None]
    given += ["process_non_loss_data_func"] if process_non_loss_data_func is not None else []
    if given:
        warnings.warn(f"pretrain(): {', '.join(given)} not supported here: ignored", stacklevel=2)
    try:
        code = _train(
            train_valid_test_dataset_provider,
            model_provider,
            forward_step_func,
            extra_args_provider,
            args_defaults,
        )
    except ConfigError as error:
        print(f"{sys.argv[0]}: error: {error}", file=sys.stderr, flush=True)
        code = ConfigError.EXIT_CODE
    if code:  # as Megatron-LM: a result that failed validation ends the process so
        raise SystemExit(code)


def _train(datasets_provider, model_provider, forward_step, extra_args_provider, defaults) -> int:
    """Parse, build, train, save: the run's exit code; ConfigError for bad flags."""
    runner = _runner()
    config = _parse(runner, defaults, extra_args_provider)
    _check_for_scripts(config)
    config.run.datasets_provider = _DatasetsProvider(datasets_provider)
    _Run.config, _Run.args = config, None
    from megatron.training import cpu_compat

    cpu_compat.import_megatron_core_without_cuda()
    provider = _ModelProvider(model_provider)
    if runner is None:
        from megatron.training.training import pretrain as train

        return train(config, provider, forward_step)
    return runner.run_training(config, provider, forward_step)

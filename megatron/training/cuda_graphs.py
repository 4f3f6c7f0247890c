"""Transformer Engine's CUDA graphs, captured and replayed through the trainer's hook points.

With --cuda-graph-impl transformer_engine, as Megatron-LM's training loop
drives them: megatron-core's TECudaGraphHelper captures each transformer
layer's forward and backward once --cuda-graph-warmup-steps iterations have
run, and the layers replay them from then on. GPU only (arguments.py refuses
it elsewhere, and under --deadpool: a graph replays the communicators it was
captured with)."""

from typing import TYPE_CHECKING, Optional

from megatron.training.hooks import Hook

if TYPE_CHECKING:
    from megatron.training.training import Trainer


class CudaGraphHook(Hook):
    def __init__(self):
        self.helper = None
        self.start_iteration: Optional[int] = None

    def on_setup(self, trainer: "Trainer") -> None:
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

        state, config = trainer.state, trainer.config
        self.helper = TECudaGraphHelper(
            model=state.model,
            config=state.tf_config,
            seq_length=config.model.seq_length,
            micro_batch_size=config.batch.micro_batch_size,
            optimizers=[state.optimizer],
        )
        self.start_iteration = trainer.progress.iteration

    def before_step(self, trainer: "Trainer") -> None:
        done = trainer.progress.iteration - self.start_iteration
        if self.helper.graphs_created() or done != trainer.config.gpu.cuda_graph_warmup_steps:
            return
        # A graphed layer runs no module hooks: with --overlap-param-gather the
        # parameters' all-gathers are waited on by hooks the helper sets by
        # hand, and none may start while the graphs are captured.
        overlapped = trainer.config.parallel.overlap_param_gather
        if overlapped:
            for chunk in trainer.state.model:
                chunk.disable_forward_pre_hook(param_sync=False)
        self.helper.create_cudagraphs()
        if overlapped:
            for chunk in trainer.state.model:
                chunk.enable_forward_pre_hook()
            self.helper.cuda_graph_set_manual_hooks()

    def on_train_end(self, trainer: "Trainer") -> None:
        if self.helper is not None and self.helper.graphs_created():
            self.helper.delete_cuda_graphs()


def cuda_graph_hooks(config) -> list:
    """The hooks a run's --cuda-graph-impl needs (none without graphs)."""
    return [CudaGraphHook()] if config.gpu.cuda_graph_impl == "transformer_engine" else []

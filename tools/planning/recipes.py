"""Training recipes: what the sbatch scripts and `make demo` train, and how.

For each run of examples/slurm/ and the Makefile's demo: the model, the
layout it is planned for and how it trains (batch, iterations, schedule,
data), as pretrain_gpt.py flags.

The paper's models and their 512-GPU layouts are the planner's
(``scale.MODELS`` and ``scale.paper_layouts``), so a script trains what
docs/scale.md sizes; its dry run (tools/slurm_plan.py) parses the flags
back and checks the shape against the planner's. tools/recipe.py prints a
recipe for examples/slurm/common.sh and the Makefile.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from tools.planning import scale


@dataclass(frozen=True)
class Recipe:
    """A run: its model, the layout it is planned for and how it trains."""

    shape: scale.ModelShape
    layout: scale.Parallel  # TP, PP, DP, the micro- and global batch, EP
    ranks_per_node: int
    train_iters: int
    schedule: Tuple[str, ...]  # optimizer and learning-rate flags
    data: Tuple[str, ...]  # data and tokenizer flags
    logging: Tuple[str, ...]  # data workers, logging and evaluation flags
    model: Optional[str] = None  # the planner's name (scale.MODELS) of the shape
    routing: Tuple[str, ...] = ()  # MoE router flags, which the planner does not model

    @property
    def nodes(self) -> int:
        return self.layout.world // self.ranks_per_node

    def model_args(self) -> List[str]:
        """The model's flags: its shape, expert parallelism and routing."""
        return shape_flags(self.shape) + expert_flags(self.layout) + list(self.routing)

    def model_flags(self) -> List[str]:
        """The layout, the model and the batch: what a snapshot's layout follows."""
        return model_flags(self.shape, self.layout) + list(self.routing)

    def flags(self) -> List[str]:
        """The whole recipe, as `make demo` passes it."""
        iters = ["--train-iters", str(self.train_iters)]
        return self.model_flags() + iters + [*self.schedule, *self.data, *self.logging]


def model_flags(shape: scale.ModelShape, layout: scale.Parallel) -> List[str]:
    """pretrain_gpt.py's flags for the planner's shape and layout (not its
    precision or recompute): TP, PP, the model, its experts and the batch."""
    return [
        *("--tensor-model-parallel-size", str(layout.tp)),
        *("--pipeline-model-parallel-size", str(layout.pp)),
        "--use-distributed-optimizer",
        *shape_flags(shape),
        *expert_flags(layout),
        *("--micro-batch-size", str(layout.micro_batch)),
        *("--global-batch-size", str(layout.global_batch)),
    ]


def expert_flags(layout: scale.Parallel) -> List[str]:
    return ["--expert-model-parallel-size", str(layout.ep)] if layout.ep > 1 else []


def shape_flags(shape: scale.ModelShape) -> List[str]:
    """pretrain_gpt.py's flags for a shape (tools/planning/slurm.py's
    model_shape reads them back); defaults are left out."""
    flags = [
        *("--num-layers", str(shape.num_layers)),
        *("--hidden-size", str(shape.hidden_size)),
        *("--num-attention-heads", str(shape.num_attention_heads)),
    ]
    if shape.num_query_groups is not None:
        flags += ["--group-query-attention", "--num-query-groups", str(shape.num_query_groups)]
    # Megatron-LM's default is 4h, but not with SwiGLU.
    if shape.swiglu or shape.ffn_hidden_size != 4 * shape.hidden_size:
        flags += ["--ffn-hidden-size", str(shape.ffn_hidden_size)]
    flags += ["--seq-length", str(shape.seq_length)]
    optional = {
        "--max-position-embeddings": shape.max_position_embeddings,
        "--kv-channels": shape.kv_channels,
    }
    flags += [word for flag, v in optional.items() if v is not None for word in (flag, str(v))]
    flags += ["--swiglu"] if shape.swiglu else []
    if shape.normalization != "LayerNorm":
        flags += ["--normalization", shape.normalization]
    if shape.position_embedding != "learned_absolute":
        flags += ["--position-embedding-type", shape.position_embedding]
    flags += [] if shape.add_bias_linear else ["--disable-bias-linear"]
    flags += [] if shape.tied_embeddings else ["--untie-embeddings-and-output-weights"]
    flags += [] if shape.dropout else ["--hidden-dropout", "0", "--attention-dropout", "0"]
    if shape.make_vocab_size_divisible_by != 128:
        flags += ["--make-vocab-size-divisible-by", str(shape.make_vocab_size_divisible_by)]
    if shape.num_experts is not None:
        flags += ["--num-experts", str(shape.num_experts)]
        if shape.moe_ffn_hidden_size is not None:
            flags += ["--moe-ffn-hidden-size", str(shape.moe_ffn_hidden_size)]
        flags += ["--moe-router-topk", str(shape.moe_router_topk)]
    return flags


def mock_data(shape: scale.ModelShape) -> Tuple[str, ...]:
    """Mock tokens over the model's vocabulary: NullTokenizer adds the
    end-of-document id to the ids below --vocab-size."""
    return (
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(shape.vocab_size - 1),
    )


# The pretraining schedule of the GPU runs, after the GPT-3 and LLaMA papers:
# Adam with beta2 0.95, weight decay 0.1, clipping at 1.0, 2000 warm-up
# iterations, cosine decay to a tenth of the peak learning rate.
def gpu_schedule(lr: str, min_lr: str) -> Tuple[str, ...]:
    return (
        *("--adam-beta1", "0.9", "--adam-beta2", "0.95", "--weight-decay", "0.1"),
        *("--clip-grad", "1.0", "--lr-warmup-iters", "2000", "--lr-decay-style", "cosine"),
        *("--lr", lr, "--min-lr", min_lr),
    )


GPU_LOGGING = (
    *("--log-interval", "10", "--log-throughput", "--eval-interval", "1000"),
    *("--eval-iters", "10", "--num-workers", "2"),
)


def perlmutter(model: str, lr: str, min_lr: str, routing: Tuple[str, ...] = ()) -> Recipe:
    """A paper model on 128 Perlmutter nodes of 4 A100s, in the planner's layout."""
    shape = scale.MODELS[model]
    return Recipe(
        shape,
        scale.paper_layouts(512)[model],
        4,
        50000,
        gpu_schedule(lr, min_lr),
        mock_data(shape),
        GPU_LOGGING,
        model,
        routing,
    )


# The demo's model: 4 layers of 128 on the byte-level tokenizer's 512 ids,
# on 8 ranks as TP2 PP2 DP2. A peak lr of 1e-3 reached over the first 10
# iterations, then cosine decay to a tenth: the loss falls smoothly (at 3e-3
# after 6 it spiked to 11).
DEMO = Recipe(
    scale.ModelShape("demo", 4, 128, 4, 512, 512, 128, max_position_embeddings=128),
    scale.Parallel(2, 2, 2, 4, 32),
    4,
    60,
    (
        *("--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine"),
        *("--lr-warmup-iters", "10", "--weight-decay", "0.1", "--clip-grad", "1.0"),
        *("--seed", "1234"),
    ),
    ("--data-path", "data/corpus_text_document", "--tokenizer-type", "ByteLevelTokenizer")
    + ("--split", "98,2,0"),
    ("--num-workers", "0", "--log-interval", "5", "--eval-interval", "30", "--eval-iters", "2"),
)

RECIPES: Dict[str, Recipe] = {
    "gpt-1.3b": perlmutter("gpt-1.3b", "2.0e-4", "2.0e-5"),
    "gpt-6.7b": perlmutter("gpt-6.7b", "1.2e-4", "1.2e-5"),
    "gpt-13b": perlmutter("gpt-13b", "1.0e-4", "1.0e-5"),
    "llama-30b": perlmutter("llama-30b", "1.5e-4", "1.5e-5"),
    "llama-65b": perlmutter("llama-65b", "1.5e-4", "1.5e-5"),
    "mixtral-8x7b": perlmutter(
        "mixtral-8x7b",
        "1.5e-4",
        "1.5e-5",
        (
            *("--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"),
            *("--moe-token-dispatcher-type", "alltoall"),
        ),
    ),
    # One GH200 per Vista node: TP across nodes would put every layer's
    # all-reduces on the network, so TP is 1 and PP 2 fits 13B in 96 GB.
    "vista-gpt-13b": Recipe(
        scale.MODELS["gpt-13b"],
        scale.Parallel(1, 2, 64, 1, 2048),
        1,
        50000,
        gpu_schedule("1.0e-4", "1.0e-5"),
        mock_data(scale.MODELS["gpt-13b"]),
        GPU_LOGGING,
        "gpt-13b",
    ),
    "demo": DEMO,
}

"""Plan a --deadpool run past this machine: memory per GPU, mirror bytes and
their time on the link, and whether the mirror hides inside one iteration.

    python -m tools.plan_scale --model llama-65b --hardware perlmutter-a100-40 \\
        --tp 4 --pp 8 --dp 16 --global-batch 2048

Everything here is arithmetic on the model's shape and the hardware's
published figures; nothing is measured by this module. Where it models our
code (the snapshot layout) it follows the code exactly, and
tests/functional_tests/test_plan_scale.py checks it against layouts built by
megatron-core itself (tools/layout_probe.py) and against the sizes real runs
logged (docs/benchmarks.md).

What a rank's snapshot holds (deadpool_ext/state/snapshot.py): a 64-byte header,
fp32 main parameters, Adam's exp_avg and exp_avg_sq of the rank's
distributed-optimizer shard (12 bytes per shard element), and a sidecar
reserve of 256 KiB + 64 bytes per parameter tensor, rounded up to 32 KiB.
The shard has sum(bucket numel / DP) elements, where buckets are megatron-core
DDP's gradient buckets with their padding (each parameter starts at a
multiple of 64 elements, each bucket ends at a multiple of lcm(DP, 128), a
shared embedding gets a bucket of its own). Each rank keeps two own
snapshots and two received ones (deadpool_ext/state/mirror.py), so the mirror's
memory is four snapshots, and one snapshot is sent and one received per
iteration. In grad mode (--deadpool-mirror-mode grad, deadpool_ext/state/replay.py)
a *packet* travels instead: a 64-byte header, the shard's fp32 gradients (4
bytes per element) and the same sidecar reserve, rounded up to 32 KiB; each
rank keeps one packet to send and one to receive beside its four snapshots.
The buddy's replay of the owner's optimizer step (one more step over the
shard, where the replica lies) is not modelled.
"""

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from deadpool_ext import topology

GiB = 2**30
MiB = 2**20

# deadpool_ext/state/snapshot.py's format constants (restated so the planner needs
# no torch; a test checks them against the module).
HEADER_BYTES = 64
CHUNK_BYTES = 4096 * 8
SIDECAR_BASE = 256 * 1024
SIDECAR_PER_PARAM = 64
SNAPSHOT_BYTES_PER_ELEMENT = 12  # fp32 main param + exp_avg + exp_avg_sq
MIRROR_BUFFERS = 4  # two own snapshots + two held ones
PACKET_BYTES_PER_ELEMENT = 4  # grad mode: each main parameter's fp32 gradient
PACKET_BUFFERS = 2  # grad mode: the packet sent and the one received
MIRROR_MODES = ("state", "grad")  # --deadpool-mirror-mode's choices

# The mirror's CPU work per byte, from our own floor measurement
# (docs/benchmarks.md: checksum 9.1 ms and verify 9.2 ms of one
# 111.5 MiB snapshot on one core of the development machine).
MEASURED_CHECKSUM_BYTES_PER_S = 111.5 * MiB / 9.15e-3


@dataclass(frozen=True)
class ModelShape:
    """A GPT's shape, in pretrain_gpt.py's flag names."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int  # unpadded; padded like training pads it
    seq_length: int
    num_query_groups: Optional[int] = None  # grouped-query attention; None: one per head
    kv_channels: Optional[int] = None  # None: hidden / heads
    swiglu: bool = False  # fc1 is two ffn-wide projections
    normalization: str = "LayerNorm"  # "RMSNorm" has no bias
    add_bias_linear: bool = True  # False: --disable-bias-linear
    position_embedding: str = "learned_absolute"  # or "rope" (no parameters)
    max_position_embeddings: Optional[int] = None  # None: seq_length
    tied_embeddings: bool = True  # False: --untie-embeddings-and-output-weights
    dropout: bool = True  # dropout masks are kept for backward
    make_vocab_size_divisible_by: int = 128
    num_experts: Optional[int] = None  # MoE: experts per layer in place of the MLP
    moe_ffn_hidden_size: Optional[int] = None  # None: ffn_hidden_size
    moe_router_topk: int = 2

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class Parallel:
    """How the job is split, and the training options that change memory."""

    tp: int
    pp: int
    dp: int
    micro_batch: int = 1
    global_batch: int = 1  # sequences per iteration
    sequence_parallel: bool = False
    recompute: str = "selective"  # "none", "selective" or "full"
    flash_attention: bool = True  # attention scores are never stored
    precision: str = "bf16"  # "bf16" (fp32 grads and main params) or "fp32"
    overlap_grad_reduce: bool = False  # gives megatron-core's bucketing (first stage)
    bucket_size: Optional[int] = None  # None: megatron-core's default
    ep: int = 1  # expert-parallel size (MoE)
    etp: Optional[int] = None  # expert tensor-parallel size; None: tp
    mirror_mode: str = "state"  # --deadpool-mirror-mode (its default: deadpool_ext/config.py)

    def __post_init__(self):
        if self.mirror_mode not in MIRROR_MODES:
            raise ValueError(f"mirror mode {self.mirror_mode!r}: one of {', '.join(MIRROR_MODES)}")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def shrink_unit(self) -> int:
        """Replicas a shrink drops together (an expert-parallel block)."""
        return topology.shrink_unit(self.tp, topology.Experts(self.expert_tp, self.ep))

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the ranks an expert's state is sharded over."""
        return self.world // (self.expert_tp * self.ep * self.pp)

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)


@dataclass(frozen=True)
class Hardware:
    """One node type; every figure is per GPU unless named per node."""

    name: str
    gpus_per_node: int
    gpu_memory_gib: float
    host_memory_gib: float  # per node
    peak_tflops: float  # dense bf16 tensor-core peak
    nic_gbps: float  # network injection bandwidth per GPU, GB/s each way
    d2h_gbps: float  # device-to-host copy bandwidth, GB/s
    source: str  # where the figures come from


HARDWARE = {
    "perlmutter-a100-40": Hardware(
        "Perlmutter A100-40GB",
        4,
        40,
        256,
        312,
        25,
        25,
        "NERSC Perlmutter architecture page: 4x A100 and 4x HPE Slingshot 11 NICs per "
        "node (Cassini, 200 Gb/s = 25 GB/s each way), 256 GB host memory; A100 datasheet: "
        "312 TFLOP/s dense bf16, PCIe 4.0 x16 to the host (32 GB/s each way peak; 25 GB/s "
        "assumed achievable)",
    ),
    "perlmutter-a100-80": Hardware(
        "Perlmutter A100-80GB",
        4,
        80,
        256,
        312,
        25,
        25,
        "as perlmutter-a100-40, the 256 large-memory GPU nodes",
    ),
    "vista-gh200": Hardware(
        "Vista GH200",
        1,
        96,
        120,
        989,
        50,
        450,
        "TACC Vista: one GH200 per node, 96 GB HBM3, 120 GB LPDDR5X, NDR InfiniBand "
        "(400 Gb/s per node assumed); NVLink-C2C 900 GB/s (450 each way); H100-class 989 "
        "TFLOP/s dense bf16",
    ),
}


# ----- parameters, in megatron-core's registration order -----
def padded_vocab(shape: ModelShape, tp: int) -> int:
    """megatron/training/training.py padded_vocab_size."""
    multiple = shape.make_vocab_size_divisible_by * tp
    return -(-shape.vocab_size // multiple) * multiple


def layer_parameters(
    shape: ModelShape, tp: int, etp: Optional[int] = None, ep: int = 1
) -> List[Tuple[str, int]]:
    """One transformer layer's tensors on one TP rank (local layer spec);
    an MoE layer's router (replicated) and this rank's experts (split over
    ``etp``, ``num_experts / ep`` of them) in place of the MLP."""
    h, bias = shape.hidden_size, shape.add_bias_linear
    attn = shape.num_attention_heads * shape.head_dim
    qkv = (shape.num_attention_heads + 2 * shape.groups) * shape.head_dim // tp
    fc1 = shape.ffn_hidden_size * (2 if shape.swiglu else 1) // tp
    norm = [("weight", h)] + ([("bias", h)] if shape.normalization == "LayerNorm" else [])
    out = [(f"input_layernorm.{n}", k) for n, k in norm]
    out += [("self_attention.linear_proj.weight", h * attn // tp)]
    out += [("self_attention.linear_proj.bias", h)] if bias else []
    out += [("self_attention.linear_qkv.weight", qkv * h)]
    out += [("self_attention.linear_qkv.bias", qkv)] if bias else []
    out += [(f"pre_mlp_layernorm.{n}", k) for n, k in norm]
    if shape.num_experts is not None:
        return out + moe_parameters(shape, etp or tp, ep)
    out += [("mlp.linear_fc1.weight", fc1 * h)] + ([("mlp.linear_fc1.bias", fc1)] if bias else [])
    out += [("mlp.linear_fc2.weight", h * shape.ffn_hidden_size // tp)]
    out += [("mlp.linear_fc2.bias", h)] if bias else []
    return out


EXPERT_PREFIX = "mlp.experts."


def moe_parameters(shape: ModelShape, etp: int, ep: int) -> List[Tuple[str, int]]:
    """An MoE layer without biases (megatron-core's local experts): the
    router's weight, then each local expert's two projections."""
    h, ffn = shape.hidden_size, shape.expert_ffn
    fc1 = ffn * (2 if shape.swiglu else 1) // etp
    out = [("mlp.router.weight", shape.num_experts * h)]
    for k in range(shape.num_experts // ep):
        expert = f"{EXPERT_PREFIX}local_experts.{k}"
        out += [
            (f"{expert}.linear_fc1.weight", fc1 * h),
            (f"{expert}.linear_fc2.weight", h * ffn // etp),
        ]
    return out


@dataclass(frozen=True)
class Tensor:
    name: str
    numel: int
    shared_embedding: bool = False  # megatron-core gives it a bucket of its own

    @property
    def expert(self) -> bool:
        """In the expert-parallel buffer, sharded over expert-DP."""
        return EXPERT_PREFIX in self.name


def stage_parameters(
    shape: ModelShape, tp: int, pp: int, stage: int, etp: Optional[int] = None, ep: int = 1
) -> List[Tensor]:
    """Every trainable tensor of one (TP rank, PP stage), in registration order."""
    h, vocab = shape.hidden_size, padded_vocab(shape, tp)
    first, last = stage == 0, stage == pp - 1
    shared = shape.tied_embeddings and pp > 1
    out = []
    if first:
        out.append(Tensor("embedding.word_embeddings.weight", vocab // tp * h, shared))
        if shape.position_embedding == "learned_absolute":
            positions = shape.max_position_embeddings or shape.seq_length
            out.append(Tensor("embedding.position_embeddings.weight", positions * h))
    per_stage = shape.num_layers // pp
    for layer in range(per_stage):
        out += [
            Tensor(f"decoder.layers.{layer}.{n}", k)
            for n, k in layer_parameters(shape, tp, etp, ep)
        ]
    if last:
        norm = ["weight"] + (["bias"] if shape.normalization == "LayerNorm" else [])
        out += [Tensor(f"decoder.final_layernorm.{n}", h) for n in norm]
        if not shape.tied_embeddings or not first:
            out.append(Tensor("output_layer.weight", vocab // tp * h, shared))
    return out


def total_parameters(shape: ModelShape) -> int:
    """The model's parameter count (tied embeddings counted once)."""
    return sum(t.numel for t in stage_parameters(shape, 1, 1, 0))


# ----- megatron-core DDP buckets and the snapshot -----
def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def bucket_sizes(tensors: List[Tensor], dp: int, bucket_size: Optional[int] = None) -> List[int]:
    """Padded bucket sizes, as megatron-core's _ParamAndGradBuffer lays them
    out for the distributed optimizer: tensors in reverse order, each starting
    at a multiple of 64, a bucket closed when it reaches ``bucket_size`` or
    around a shared embedding, each bucket padded to lcm(dp, 128)."""
    divisor = math.lcm(dp, 128)
    sizes, start, position, count = [], 0, 0, 0

    def close(end: int) -> int:
        padded = _round_up(end, divisor)
        sizes.append(padded - start)
        return padded

    for tensor in reversed(tensors):
        position = _round_up(position, 64)
        if tensor.shared_embedding and count:
            start = position = close(position)
            count = 0
        end, count = position + tensor.numel, count + 1
        if (bucket_size is not None and end - start >= bucket_size) or tensor.shared_embedding:
            start = position = close(end)
            count = 0
        else:
            position = end
    if count:
        close(position)
    return sizes


def ddp_bucket_size(par: Parallel, stage: int) -> Optional[int]:
    """megatron-core DDP: buckets only with overlapped reduction, on stage 0."""
    if not par.overlap_grad_reduce or stage > 0:
        return None
    return par.bucket_size or max(40_000_000, 1_000_000 * par.dp)


def snapshot_bytes(shard_numel: int, num_tensors: int) -> int:
    """deadpool_ext.state.snapshot.ShardLayout.nbytes for a shard of this size."""
    return _buffer_bytes(SNAPSHOT_BYTES_PER_ELEMENT, shard_numel, num_tensors)


def packet_bytes(shard_numel: int, num_tensors: int) -> int:
    """deadpool_ext.state.replay.packet_bytes for a shard of this size."""
    return _buffer_bytes(PACKET_BYTES_PER_ELEMENT, shard_numel, num_tensors)


def _buffer_bytes(per_element: int, shard_numel: int, num_tensors: int) -> int:
    sidecar = SIDECAR_BASE + SIDECAR_PER_PARAM * num_tensors
    return _round_up(HEADER_BYTES + per_element * shard_numel + sidecar, CHUNK_BYTES)


@dataclass(frozen=True)
class Layout:
    """One rank's buffers and snapshot, as our code and megatron-core size them."""

    tensors: int  # trainable parameter tensors
    params: int  # unpadded parameters on this rank
    buffer_numel: int  # DDP buffer elements, with padding
    shard_numel: int  # distributed-optimizer shard: elements per state
    snapshot_bytes: int  # one snapshot
    packet_bytes: int = 0  # one grad-mode packet; 0 in state mode

    @property
    def sent_bytes(self) -> int:
        """What a rank sends its buddy per iteration (and receives from its owner)."""
        return self.packet_bytes or self.snapshot_bytes

    @property
    def mirror_bytes(self) -> int:
        return MIRROR_BUFFERS * self.snapshot_bytes + PACKET_BUFFERS * self.packet_bytes


def rank_layout(shape: ModelShape, par: Parallel, stage: int) -> Layout:
    """The dense tensors' buckets are sharded over DP, an MoE model's expert
    tensors' (a buffer of their own) over expert-DP."""
    tensors = stage_parameters(shape, par.tp, par.pp, stage, par.etp, par.ep)
    dense = [t for t in tensors if not t.expert]
    experts = [t for t in tensors if t.expert]
    buckets = bucket_sizes(dense, par.dp, ddp_bucket_size(par, stage))
    expert_buckets = bucket_sizes(experts, par.edp, ddp_bucket_size(par, stage)) if experts else []
    shard = sum(b // par.dp for b in buckets) + sum(b // par.edp for b in expert_buckets)
    buckets += expert_buckets
    packet = packet_bytes(shard, len(tensors)) if par.mirror_mode == "grad" else 0
    return Layout(
        len(tensors),
        sum(t.numel for t in tensors),
        sum(buckets),
        shard,
        snapshot_bytes(shard, len(tensors)),
        packet,
    )


# ----- memory per GPU -----
def element_bytes(par: Parallel) -> int:
    return 2 if par.precision == "bf16" else 4


def state_bytes(layout: Layout, par: Parallel) -> Dict[str, int]:
    """Weights, gradients and optimizer shard. bf16 keeps fp32 gradients
    (grad_reduce_in_fp32) and fp32 main params + two moments in the shard
    (6 + 12/DP bytes per parameter); fp32 main params are views of the
    weights, so only the moments are extra (8 + 8/DP)."""
    optimizer = 12 if par.precision == "bf16" else 8
    return {
        "weights": layout.buffer_numel * element_bytes(par),
        "gradients": layout.buffer_numel * 4,
        "optimizer": layout.shard_numel * optimizer,
    }


def layer_activation_bytes(shape: ModelShape, par: Parallel, micro_batch: int) -> int:
    """Bytes one layer keeps for backward per microbatch, term by term after
    Korthikanti et al. 2022 (arXiv 2205.05198), generalised to
    grouped-query attention and SwiGLU. Tensors inside the TP region are
    split by TP; the rest (norm inputs, QKV and fc1 inputs, dropout masks) by
    TP only with sequence parallelism. Without flash attention or selective
    recompute the attention scores (5·a·s²·b/t) are kept too."""
    s, h, t = shape.seq_length, shape.hidden_size, par.tp
    e, sb = element_bytes(par), shape.seq_length * micro_batch
    if par.recompute == "full":
        return e * sb * h // (t if par.sequence_parallel else 1)
    attn = shape.num_attention_heads * shape.head_dim
    masks = 2 * sb * h if shape.dropout else 0
    replicated = e * sb * h * 4 + masks  # 2 norm inputs, QKV input, fc1 input
    mlp = shape.ffn_hidden_size * (3 if shape.swiglu else 2)
    if shape.num_experts is not None:
        # Each token reaches top-k experts: its permuted copies (the experts'
        # fc1 input) and their intermediates are kept, split over expert TP
        # (taken as TP here), and the router's logits.
        k = shape.moe_router_topk
        replicated += e * sb * (k * h + shape.num_experts)
        mlp = k * shape.expert_ffn * (3 if shape.swiglu else 2)
    split = (
        e
        * sb
        * (
            (shape.num_attention_heads + 2 * shape.groups) * shape.head_dim
            + attn  # attention output = proj input
            + mlp
        )
    )
    scores = 0
    if not par.flash_attention and par.recompute == "none":
        scores = (2 * e + (1 if shape.dropout else 0)) * shape.num_attention_heads * s * sb
    return (replicated // (t if par.sequence_parallel else 1)) + (split + scores) // t


def stage_activation_bytes(shape: ModelShape, par: Parallel, stage: int) -> int:
    """1F1B keeps min(PP - stage, microbatches) microbatches in flight on a
    stage; with full recompute one layer's full activations come back during
    its backward. The last stage also holds the logits (bf16 and the fp32
    copy cross-entropy makes) of one microbatch."""
    in_flight = min(par.pp - stage, max(par.microbatches, 1))
    layers = shape.num_layers // par.pp
    stored = layers * in_flight * layer_activation_bytes(shape, par, par.micro_batch)
    if par.recompute == "full":
        stored += layer_activation_bytes(
            shape, replace(par, recompute="selective"), par.micro_batch
        )
    if stage == par.pp - 1:
        logits = shape.seq_length * par.micro_batch * padded_vocab(shape, par.tp) // par.tp
        stored += logits * (element_bytes(par) + 4)
    return stored


@dataclass(frozen=True)
class Memory:
    stage: int
    parts: Dict[str, int]  # bytes on the GPU by component (mirror only if in device)
    mirror_bytes: int
    mirror_in_device: bool

    @property
    def total(self) -> int:
        return sum(self.parts.values())


# CUDA context, NCCL buffers, allocator slack: an assumption, not measured.
RESERVED_BYTES = 2 * GiB


def stage_memory(
    shape: ModelShape, par: Parallel, stage: int, mirror_in_device: bool = False
) -> Memory:
    layout = rank_layout(shape, par, stage)
    parts = dict(state_bytes(layout, par))
    parts["activations"] = stage_activation_bytes(shape, par, stage)
    parts["reserved"] = RESERVED_BYTES
    if mirror_in_device:
        parts["mirror"] = layout.mirror_bytes
    return Memory(stage, parts, layout.mirror_bytes, mirror_in_device)


def worst_stage_memory(shape: ModelShape, par: Parallel, mirror_in_device: bool = False) -> Memory:
    return max(
        (stage_memory(shape, par, s, mirror_in_device) for s in range(par.pp)),
        key=lambda m: m.total,
    )


# ----- time -----
def flops_per_token(shape: ModelShape) -> float:
    """Model FLOPs (no recompute) per trained token: 6 per matmul weight
    (forward 2, backward 4) plus attention's 12·L·s·(heads·head_dim), after
    PaLM (Chowdhery et al. 2022, appendix B). Embedding lookups, norms and
    biases are not matmuls and are left out. An MoE token goes through its
    top-k experts only (and the router)."""
    weights = [
        (n, k)
        for n, k in layer_parameters(shape, 1)
        if n.endswith("weight") and "layernorm" not in n
    ]
    per_layer = sum(k for n, k in weights if EXPERT_PREFIX not in n)
    if shape.num_experts is not None:
        experts = sum(k for n, k in weights if EXPERT_PREFIX in n)
        per_layer += experts * shape.moe_router_topk // shape.num_experts
    matmul = shape.num_layers * per_layer + padded_vocab(shape, 1) * shape.hidden_size
    attention = (
        12 * shape.num_layers * shape.seq_length * (shape.num_attention_heads * shape.head_dim)
    )
    return 6 * matmul + attention


def iteration_seconds(shape: ModelShape, par: Parallel, hw: Hardware, mfu: float) -> float:
    tokens = par.global_batch * shape.seq_length
    return flops_per_token(shape) * tokens / (par.world * hw.peak_tflops * 1e12 * mfu)


@dataclass(frozen=True)
class MirrorTime:
    """Per rank and iteration; all in seconds."""

    link: float  # what is sent on the NIC (send and receive overlap: full duplex)
    copy: float  # device-to-host copy of what is sent (host mirror only)
    cpu: float  # checksum of the own snapshot + verification of the received one
    # (grad mode: the seal of the replica the buddy advanced, as many bytes)
    training_link: float  # DP reduce-scatter + all-gather and PP sends, same NIC
    iteration: float

    @property
    def critical(self) -> float:
        """The longest of the mirror's stages: they run as a pipeline on
        different engines (DMA, CPU, NIC) behind forward and backward."""
        return max(self.link, self.copy, self.cpu)

    @property
    def hides(self) -> bool:
        """Step t waits for snapshot t's exchange, which starts when iteration
        t does: it hides when it fits in the iteration beside training's own
        traffic on the same link."""
        return self.critical + self.training_link <= self.iteration

    @property
    def exposed(self) -> float:
        return max(0.0, self.critical + self.training_link - self.iteration)


def training_link_bytes(shape: ModelShape, par: Parallel, layout: Layout) -> float:
    """What training itself sends per rank per iteration over the NIC: the
    distributed optimizer's gradient reduce-scatter (fp32) and parameter
    all-gather (ring: (DP-1)/DP of the buffer each), and the pipeline's
    activation and gradient sends (split by TP with sequence parallelism).
    Tensor parallelism stays inside the node (TP <= GPUs per node)."""
    ring = (par.dp - 1) / par.dp
    dp_bytes = layout.buffer_numel * (4 + element_bytes(par)) * ring
    per = shape.seq_length * par.micro_batch * shape.hidden_size * element_bytes(par)
    pp_bytes = 0.0
    if par.pp > 1:
        pp_bytes = 2 * par.microbatches * per / (par.tp if par.sequence_parallel else 1)
    ep_bytes = 0.0
    if shape.num_experts is not None and par.ep > 1:
        # Expert buffers reduce over expert-DP, not DP (the whole buffer
        # above counts them at the DP ring's share: close for large groups).
        # Each MoE layer sends every token's top-k copies out and back, in
        # forward and in backward (all-to-all: (EP-1)/EP of them leave).
        layers = shape.num_layers // par.pp
        share = (par.ep - 1) / par.ep
        ep_bytes = 4 * layers * par.microbatches * per * shape.moe_router_topk * share
    return dp_bytes + pp_bytes + ep_bytes


def mirror_time(
    shape: ModelShape,
    par: Parallel,
    hw: Hardware,
    mfu: float,
    mirror_in_device: bool = False,
    stage: int = 0,
) -> MirrorTime:
    layout = rank_layout(shape, par, stage)
    sent = layout.sent_bytes
    return MirrorTime(
        link=sent / (hw.nic_gbps * 1e9),
        copy=0.0 if mirror_in_device else sent / (hw.d2h_gbps * 1e9),
        cpu=2 * layout.snapshot_bytes / MEASURED_CHECKSUM_BYTES_PER_S,
        training_link=training_link_bytes(shape, par, layout) / (hw.nic_gbps * 1e9),
        iteration=iteration_seconds(shape, par, hw, mfu),
    )


# ----- the paper's runs -----
def gpt3(name: str, layers: int, hidden: int, heads: int) -> ModelShape:
    """GPT-3 shapes (Brown et al. 2020, table 2.1): 4h GELU MLP, learned
    positions, GPT-2's 50257-token vocabulary, sequence 2048."""
    return ModelShape(name, layers, hidden, heads, 4 * hidden, 50257, 2048)


def llama(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelShape:
    """LLaMA shapes (Touvron et al. 2023, table 2): SwiGLU, RMSNorm, rotary
    positions, no linear biases, untied output layer, 32000 tokens, no dropout."""
    return ModelShape(
        name,
        layers,
        hidden,
        heads,
        ffn,
        32000,
        2048,
        swiglu=True,
        normalization="RMSNorm",
        add_bias_linear=False,
        position_embedding="rope",
        tied_embeddings=False,
        dropout=False,
    )


def mixtral_8x7b() -> ModelShape:
    """Mixtral 8x7B (Jiang et al. 2024, arXiv 2401.04088, table 1): Mistral
    7B's layers (32 x 4096, 32 heads, 8 KV heads, SwiGLU 14336, RMSNorm,
    rotary, no biases, untied output, 32000 tokens) with 8 experts, top-2;
    46.7B parameters, 12.9B active per token; trained here at 4096 tokens."""
    layers = llama("Mixtral 8x7B", 32, 4096, 32, 14336)
    return replace(layers, seq_length=4096, num_query_groups=8, num_experts=8, moe_router_topk=2)


MODELS = {
    "gpt-1.3b": gpt3("GPT 1.3B", 24, 2048, 16),
    "gpt-6.7b": gpt3("GPT 6.7B", 32, 4096, 32),
    "gpt-13b": gpt3("GPT 13B", 40, 5120, 40),
    "llama-30b": llama("LLaMA 30B-class (33B)", 60, 6656, 52, 17920),
    "llama-65b": llama("LLaMA 65B", 80, 8192, 64, 22016),
    "mixtral-8x7b": mixtral_8x7b(),
}


def paper_layouts(gpus: int = 512) -> Dict[str, Parallel]:
    """Our choice of layout for 4-GPU nodes: TP within a node (NVLink) first,
    then PP, the first that keeps the worst stage under two thirds of 40 GB
    with selective recompute (the activations are an estimate, and the rest
    leaves room for the mirror in GPU memory), DP for the rest.
    Every model takes LLaMA's 4M-token batch (2048 x 2048): at 512 GPUs the
    GPT-3 paper's 1-2M-token batches would leave the small models' gradient
    traffic longer than their compute. Mixtral's 4096-token sequences make
    its 4M-token batch 1024 sequences; EP 8 gives each of 8 nodes one expert,
    split over its 4 GPUs by expert TP 4 (expert-DP 16)."""

    def par(tp, pp):
        return Parallel(tp, pp, gpus // (tp * pp), 1, 2048, sequence_parallel=tp > 1)

    return {
        "gpt-1.3b": par(1, 1),
        "gpt-6.7b": par(2, 1),
        "gpt-13b": par(4, 1),
        "llama-30b": par(4, 4),
        "llama-65b": par(4, 8),
        "mixtral-8x7b": replace(par(4, 1), global_batch=1024, ep=8),
    }


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    parallel: Parallel
    hardware: Hardware
    mfu: float
    memory: Memory
    layout: Layout  # of the worst stage
    time: MirrorTime
    host_mirror_per_node: int  # bytes, mirror in host memory, all ranks of a node

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.hardware.gpu_memory_gib * GiB

    @property
    def host_fits(self) -> bool:
        return self.memory.mirror_in_device or (
            self.host_mirror_per_node <= self.hardware.host_memory_gib * GiB
        )


def plan(
    shape: ModelShape, par: Parallel, hw: Hardware, mfu: float, mirror_in_device: bool = False
) -> Plan:
    memory = worst_stage_memory(shape, par, mirror_in_device)
    layout = rank_layout(shape, par, memory.stage)
    time = mirror_time(shape, par, hw, mfu, mirror_in_device, memory.stage)
    largest = max(rank_layout(shape, par, s).mirror_bytes for s in range(par.pp))
    return Plan(shape, par, hw, mfu, memory, layout, time, largest * hw.gpus_per_node)


def experts_of(par: Parallel) -> str:
    return f" EP{par.ep} expert-TP{par.expert_tp} expert-DP{par.edp}"


def describe(p: Plan) -> str:
    par, m, t = p.parallel, p.memory, p.time
    lines = [
        f"{p.model.name} on {par.world} x {p.hardware.name}: TP{par.tp} PP{par.pp} "
        f"DP{par.dp}{experts_of(par) if p.model.num_experts else ''}, "
        f"{par.global_batch} x {p.model.seq_length} tokens, MFU {p.mfu:.2f}",
        f"  worst stage {m.stage}: "
        + ", ".join(f"{k} {v / GiB:.2f}" for k, v in m.parts.items())
        + f" GiB; total {m.total / GiB:.1f} of {p.hardware.gpu_memory_gib} GiB"
        + (" (fits)" if p.fits else " (does NOT fit)"),
        f"  shard {p.layout.shard_numel / 1e6:.1f} M elements; snapshot "
        f"{p.layout.snapshot_bytes / MiB:.1f} MiB; {par.mirror_mode} mode sends "
        f"{p.layout.sent_bytes / MiB:.1f} MiB per iteration; mirror {m.mirror_bytes / GiB:.2f} GiB "
        f"per GPU in {'device' if m.mirror_in_device else 'host'} memory "
        f"({p.host_mirror_per_node / GiB:.1f} GiB per node)",
        f"  iteration {t.iteration:.2f} s; mirror on the link {t.link * 1e3:.1f} ms "
        f"({t.link / t.iteration:.2%}), copy {t.copy * 1e3:.1f} ms, CPU "
        f"{t.cpu * 1e3:.1f} ms; training's own link time {t.training_link:.2f} s; "
        f"{'hides' if t.hides else f'exposed {t.exposed:.2f} s'}",
    ]
    return "\n".join(lines)

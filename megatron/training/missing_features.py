"""Megatron-LM's features that pretrain_gpt.py does not have, with the
flags that select them and why they are not here. Pure data: the refusal
of an unknown flag names the feature (arguments.unknown_flags_message), and
so do docs/megatron-lm-flags.md (tools/flag_parity) and the report on
Megatron-LM's own configs (tools/upstream_configs)."""

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple


@dataclass(frozen=True)
class MissingFeature:
    name: str
    why: str  # why it is not here, and what to use instead where there is something
    flags: Tuple[str, ...] = ()
    prefixes: Tuple[str, ...] = ()  # every flag that starts so

    def selects(self, flag: str) -> bool:
        return flag in self.flags or flag.startswith(self.prefixes)


MISSING_FEATURES = (
    MissingFeature(
        "megatron-core's own CUDA graphs",
        "not built here (--cuda-graph-impl local and the inference graphs): Transformer "
        "Engine's are, --cuda-graph-impl transformer_engine",
        flags=(
            "--enable-cuda-graph",
            "--inference-rng-tracker",
            "--decode-only-cuda-graphs",
            "--moe-pad-experts-for-cuda-graph-inference",
        ),
    ),
    MissingFeature(
        "fully sharded data parallelism (Megatron-FSDP, torch FSDP2)",
        "not here: the buddy mirror and the hot swap are built on the distributed "
        "optimizer's shards; use --use-distributed-optimizer",
        flags=(
            "--use-megatron-fsdp",
            "--use-torch-fsdp2",
            "--data-parallel-sharding-strategy",
            "--outer-dp-sharding-strategy",
            "--suggested-communication-unit-size",
            "--enable-full-sharding-in-hsdp",
            "--no-strict-fsdp-dtensor-load",
            "--disable-strict-fsdp-dtensor-load",
            "--init-model-with-meta-device",
            "--keep-fp8-transpose-cache",
            "--no-gradient-reduce-div-fusion",
        ),
        prefixes=("--fsdp-", "--torch-fsdp2-"),
    ),
    MissingFeature(
        "layer-wise activation offloading",
        "GPU only (copies on CUDA streams) and not built here: the fine-grained one is "
        "(--fine-grained-activation-offloading)",
        flags=("--cpu-offloading-num-layers",),
    ),
    MissingFeature(
        "optimizer offloading to the CPU",
        "not built here: the mirror sends each optimizer shard from where the step keeps it",
        flags=(
            "--optimizer-cpu-offload",
            "--optimizer-offload-fraction",
            "--use-torch-optimizer-for-cpu-offload",
            "--overlap-cpu-optimizer-d2h-h2d",
            "--no-pin-cpu-grads",
            "--no-pin-cpu-params",
        ),
    ),
    MissingFeature(
        "the Muon optimizer",
        "not here: megatron-core's Muon needs the emerging_optimizers package, whose "
        "releases need Python 3.12 (these machines have 3.11)",
        prefixes=("--muon-",),
    ),
    MissingFeature(
        "reinforcement learning (GRPO)",
        "not here: its loop runs an inference engine inside the training job; this build "
        "pretrains only",
        flags=("--perform-rl-step", "--refit-method"),
        prefixes=("--grpo-", "--rl-", "--no-rl-", "--langrl-", "--no-langrl-"),
    ),
    MissingFeature(
        "inference",
        "not here: Megatron-LM's inference engine and server; this build pretrains only",
        flags=(
            "--max-tokens-to-oom",
            "--flash-decode",
            "--enable-chunked-prefill",
            "--disable-chunked-prefill",
            "--nccl-all-reduce-for-prefill",
            "--mlp-chunks-for-prefill",
            "--use-legacy-static-engine",
            "--cache-mla-latents",
        ),
        prefixes=("--inference-", "--no-inference-"),
    ),
    MissingFeature(
        "linear and sparse attention variants (gated delta net, DSA)",
        "not built here: experimental in megatron-core 0.16, and gated delta net needs "
        "the flash-linear-attention kernels",
        flags=("--experimental-attention-variant", "--attention-output-gate"),
        prefixes=("--linear-", "--dsa-"),
    ),
    MissingFeature(
        "hybrid Mamba models",
        "not here: Megatron-LM's pretrain_mamba.py builds them; this build trains GPT models",
        flags=(
            "--is-hybrid-model",
            "--hybrid-attention-ratio",
            "--hybrid-mlp-ratio",
            "--hybrid-override-pattern",
            "--disable-mamba-mem-eff-path",
        ),
        prefixes=("--mamba-",),
    ),
    MissingFeature(
        "knowledge distillation and export (NVIDIA ModelOpt)",
        "not here: flags of the modelopt package's plugin to Megatron-LM",
        prefixes=("--export-",),
    ),
    MissingFeature(
        "other models' flags (BERT, T5, vision, retrieval)",
        "not here: this build trains GPT models (pretrain_gpt.py)",
        flags=(
            "--num-classes",
            "--img-h",
            "--img-w",
            "--num-channels",
            "--patch-dim",
            "--classes-fraction",
            "--data-per-class-fraction",
            "--no-data-sharding",
            "--head-lr-mult",
            "--mask-type",
            "--mask-factor",
            "--iter-per-epoch",
            "--titles-data-path",
            "--query-in-block-prob",
            "--use-one-sent-docs",
            "--evidence-data-path",
            "--block-data-path",
            "--embedding-path",
            "--encoder-num-layers",
            "--decoder-num-layers",
            "--encoder-seq-length",
            "--decoder-seq-length",
            "--mask-prob",
            "--short-seq-prob",
            "--vocab-extra-ids",
            "--output-bert-embeddings",
        ),
        prefixes=(
            "--bert-",
            "--ict-",
            "--biencoder-",
            "--dino-",
            "--vision-",
            "--swin-",
            "--retriever-",
            "--indexer-",
            "--relative-attention-",
        ),
    ),
    MissingFeature(
        "in-process restart and NVIDIA's fault-tolerance package",
        "not here: --deadpool's hot swap takes their place (docs/launchers.md compares them)",
        flags=("--enable-ft-package", "--calc-ft-timeouts", "--ft-num-warmup-iters"),
        prefixes=("--inprocess-",),
    ),
    MissingFeature(
        "local non-persistent checkpoints and their replication",
        "not here: the buddy mirror keeps each rank's state in a peer's memory instead",
        flags=("--replication", "--replication-jump", "--replication-factor"),
        prefixes=("--non-persistent-local-ckpt-",),
    ),
    MissingFeature(
        "FP4 and quantization extensions",
        "GPU only (Blackwell, NVIDIA's kitchen) and not built here",
        flags=(
            "--use-kitchen-attention",
            "--kitchen-attention-backend",
            "--fp8-quantizer-factory",
            "--te-precision-config-file",
        ),
        prefixes=("--fp4-",),
    ),
    MissingFeature(
        "Megatron-LM's straggler detector",
        "not built here: it samples GPU clocks and power with NVML",
        flags=("--log-straggler", "--disable-straggler-on-startup"),
        prefixes=("--straggler-",),
    ),
    MissingFeature(
        "NVIDIA's telemetry (One Logger)",
        "not here: an NVIDIA-internal service",
        flags=("--no-one-logger",),
        prefixes=("--one-logger-", "--app-tag-"),
    ),
)


def missing_feature(flag: str) -> Optional[MissingFeature]:
    """The feature of Megatron-LM's that ``flag`` selects, where it is one
    of the above."""
    return next((f for f in MISSING_FEATURES if f.selects(flag)), None)


def by_feature(flags: Iterable[str]) -> Dict[Optional[MissingFeature], List[str]]:
    """``flags`` grouped by the missing feature each selects (None: no
    feature above), in the order first seen."""
    groups: Dict[Optional[MissingFeature], List[str]] = {}
    for flag in flags:
        groups.setdefault(missing_feature(flag), []).append(flag)
    return groups

"""Megatron GPT pretraining with DeadPool hot-swap recovery, on megatron-core."""

from setuptools import find_namespace_packages, setup

setup(
    name="megatron-deadpool",
    version="0.1.0",
    description=__doc__,
    license="BSD-3-Clause",  # LICENSE; NOTICE for the examples copied from Megatron-LM
    python_requires=">=3.10",
    # megatron/ is a namespace package: ours is megatron.training, the
    # megatron-core wheel provides megatron.core beside it. tools/ is not
    # installed: its scripts run from the checkout as `python -m tools.NAME`.
    packages=find_namespace_packages(include=["megatron.training*", "deadpool_ext*"]),
    py_modules=["pretrain_gpt"],
    install_requires=[
        "torch>=2.6",
        # 0.16.x is the last line on Python 3.11; newer wheels also ship a
        # megatron.training that would collide with ours.
        "megatron-core>=0.16.1,<0.17",
        # NVML: the agents read their GPUs' health before a spare is used
        # (deadpool_ext/control/gpu_health.py); on a CPU it finds no driver.
        "nvidia-ml-py",
        # dist_checkpointing's writer processes report their memory with it;
        # without it a torch_dist save waits forever for them.
        "psutil",
        "numpy",
        "matplotlib",  # the demo's loss curve and recovery timeline
        # Megatron-LM's tokenizer kinds, offline (megatron.training.tokenizer):
        # GPT-2 BPE, SentencePiece, TikToken and Hugging Face directories.
        "tokenizers",
        "sentencepiece",
        "tiktoken",
        "transformers",
        "tensorboard",  # --tensorboard-dir (torch's SummaryWriter)
        "xxhash",  # the mirror's snapshot checksum (XXH3)
        # megatron-core's rank layout of partial distributed optimizers
        # (--num-distributed-optimizer-instances) rearranges ranks with it.
        "einops",
        # --deadpool-metrics-port: the coordinator's state for Prometheus
        "prometheus_client",
        # The coordinator's record goes to the standby as JSON generated
        # from its types, and comes back checked (control/record.py).
        "pydantic>=2",
    ],
    entry_points={
        "console_scripts": [
            "deadpool-launch = deadpool_ext.launch:main",
            "deadpool-ctl = deadpool_ext.ctl:main",
        ],
        # megatron.training.pretrain (a script written against Megatron-LM's
        # API) runs with recovery through it; megatron/training never imports it.
        "megatron.training.runners": ["deadpool = deadpool_ext.entry"],
    },
    extras_require={
        # NVIDIA's Apex is not on PyPI (PyPI's "apex" is another project,
        # which megatron-core's "is apex importable" checks would take for
        # it): it is built from source, docs/gpu.md says how.
        "gpu": ["transformer-engine[pytorch]"],
        "wandb": ["wandb"],  # --wandb-project
        "test": ["pytest", "pytest-timeout", "ruff~=0.17.6", "wandb"],  # ruff: a minor release may reformat
    },
)

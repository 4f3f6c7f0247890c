"""Datasets from megatron.core.datasets, and iterators that a sample count alone determines.

The iterators are a pure function of the number of samples consumed, so a
run can resume, or redo an iteration, from nothing but that count."""

import os
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

from megatron.training.config import Config, split_numbers
from megatron.training.fim import FIMDataset, FIMDatasetConfig, fim_settings
from megatron.training.schedule import GlobalBatch


def dataset_sizes(config: Config) -> List[int]:
    """Samples needed from train, valid and test over the whole run, as
    Megatron-LM: every validation's, and one more --eval-iters for the test
    split at the end."""
    t, log, gbs = config.training, config.logging, config.batch.global_batch_size
    evals = (t.train_iters // log.eval_interval + 1) * log.eval_iters
    return [t.train_samples or t.train_iters * gbs, evals * gbs, log.eval_iters * gbs]


def split_weights(split: str) -> List[float]:
    weights = [float(w) for w in split_numbers(split)]
    return (weights + [0.0, 0.0, 0.0])[:3]


def used_splits(config: Config) -> List[bool]:
    """Train, valid, test: whether samples are drawn from each."""
    return [size > 0 for size in dataset_sizes(config)]


def documents_per_split(num_documents: int, weights: Sequence[float]) -> List[int]:
    """How megatron-core cuts documents into splits: its own normalised split
    matrix, each bound rounded as its builder rounds it."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
    )

    total = sum(weights)
    matrix = convert_split_vector_to_split_matrix([w / total for w in weights])
    return [
        0
        if bounds is None
        else int(round(bounds[1] * float(num_documents)))
        - int(round(bounds[0] * float(num_documents)))
        for bounds in matrix
    ]


def check_splits(config: Config) -> None:
    """Each split we draw samples from must own at least one document."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    weights, used = split_weights(config.data.split), used_splits(config)
    names = ("train", "valid", "test")
    for prefix in blend(config.data.data_path)[0]:
        counts = documents_per_split(len(IndexedDataset(prefix).document_indices) - 1, weights)
        for name, weight, count, drawn in zip(names, weights, counts, used):
            if drawn and weight > 0 and count == 0:
                raise ValueError(
                    f"--split {config.data.split} gives the {name} split of {prefix} no "
                    f"document ({sum(counts)} in all): give it a larger share, or a "
                    f"weight of 0 if it is the test split, or set --eval-iters 0 (no "
                    f"validation and no test)"
                )


def index_cache_dirs(config: Config) -> List[str]:
    """Where megatron-core keeps (and looks for) the datasets' index arrays:
    --data-cache-path, else a cache directory beside each data prefix."""
    d = config.data
    if d.mock_data:
        return [d.data_cache_path] if d.data_cache_path else []
    if d.data_cache_path:
        return [d.data_cache_path]
    return [os.path.join(p, "cache", "GPTDataset_indices") for p in blend(d.data_path)[0]]


def check_index_cache(directory: str) -> None:
    """megatron-core loads its cached index arrays with numpy's
    allow_pickle=True, which unpickles (runs) any file that is not a plain
    .npy array: whoever can write the cache directory could run code in
    every rank. So each .npy file there must be a plain array before any is
    loaded."""
    if not os.path.isdir(directory):
        return
    for name in sorted(os.listdir(directory)):
        if name.endswith(".npy") and not _is_plain_array(os.path.join(directory, name)):
            raise ValueError(
                f"{os.path.join(directory, name)} in the dataset index cache is not a plain "
                "numpy array (megatron-core would unpickle it, running whatever code it holds): "
                "delete it, or give --data-cache-path a directory only this job writes"
            )


def _is_plain_array(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            version = numpy.lib.format.read_magic(f)
            read = {
                (1, 0): numpy.lib.format.read_array_header_1_0,
                (2, 0): numpy.lib.format.read_array_header_2_0,
            }.get(version)
            if read is None:
                return False
            dtype = read(f)[2]
    except (OSError, ValueError, SyntaxError):
        return False
    return not dtype.hasobject


def blend(data_path: Optional[Sequence[str]]):
    """(prefixes, weights) from '--data-path P' or '--data-path W1 P1 W2 P2'."""
    if not data_path:
        return None
    if len(data_path) > 1 and len(data_path) % 2 == 0:
        try:
            weights = [float(w) for w in data_path[0::2]]
            return list(data_path[1::2]), weights
        except ValueError:
            pass
    return list(data_path), None


def gpt_dataset_config(config: Config, tokenizer) -> GPTDatasetConfig:
    """megatron-core's config: --split's document boundaries as Megatron-LM's
    (the whole split string), and no dataset built for a split we draw
    nothing from (megatron-core loops forever on a split that owns no
    document, and building an unused one costs time)."""
    d = config.data
    make, fim = GPTDatasetConfig, {}
    if d.fim_data:
        make, fim = FIMDatasetConfig, fim_settings(d, tokenizer)
    dataset_config = make(
        **fim,
        random_seed=config.training.seed,
        sequence_length=config.model.seq_length,
        blend=blend(d.data_path),
        split=d.split,
        path_to_cache=d.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        # The causal mask is implied by the attention layers; a dense mask is
        # only needed when documents must not attend to each other.
        create_attention_mask=d.reset_attention_mask and d.create_attention_mask_in_dataloader,
        mmap_bin_files=d.mmap_bin_files,
        mid_level_dataset_surplus=0.005,
    )
    if dataset_config.split_matrix is not None:
        dataset_config.split_matrix = [
            bounds if drawn else None
            for bounds, drawn in zip(dataset_config.split_matrix, used_splits(config))
        ]
    return dataset_config


def build_datasets(config: Config, tokenizer):
    """(train, valid, test) datasets; every rank builds them (the builder
    holds barriers), data-holding or not. A script written against
    Megatron-LM's API builds its own (megatron_lm.py: its provider, given
    the numbers of samples)."""
    provider = config.run.datasets_provider
    if provider is not None:
        return tuple(provider(config, dataset_sizes(config), tokenizer))
    cls = MockGPTDataset if config.data.mock_data else GPTDataset
    if config.data.fim_data:
        cls = FIMDataset
    builder = BlendedMegatronDatasetBuilder(
        cls, dataset_sizes(config), lambda: True, gpt_dataset_config(config, tokenizer)
    )
    return builder.build()


def microbatch_indices(
    consumed_samples: int, microbatch: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> List[int]:
    """Sample indices of one microbatch of one DP rank.

    Megatron's order: the iteration's samples are cut into chunks of
    micro_batch_size x DP, chunk k is microbatch k, and DP rank r takes
    slice r of each chunk.
    """
    start = consumed_samples + microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size
    return list(range(start, start + micro_batch_size))


def microbatches_per_iteration(
    global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> int:
    """This DP rank's quota of the iteration's G/mbs microbatch slots.

    Slot k (samples [k*mbs, (k+1)*mbs) of the iteration) goes to DP rank
    k mod DP, which is Megatron's order when DP divides the slots; when it
    does not (a job shrunk to fewer replicas), the first slots-mod-DP ranks
    take one microbatch more, and the iteration still sees every sample once.
    """
    slots = global_batch_size // micro_batch_size
    return slots // dp_size + (1 if dp_rank < slots % dp_size else 0)


class MicrobatchSampler:
    """Yields this DP rank's microbatches from ``consumed_samples`` on.

    With ``global_batch_size`` (a size, or the size at a count of consumed
    samples: --rampup-batch-size) it walks whole iterations and takes this
    rank's quota of each (``microbatches_per_iteration``); the order is the
    same as without it whenever DP divides the iteration's microbatches."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        global_batch_size: Union[None, int, Callable[[int], int]] = None,
    ):
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.global_batch_size = global_batch_size

    def __iter__(self) -> Iterator[List[int]]:
        if self.global_batch_size is not None:
            yield from self._by_iteration()
            return
        step = self.micro_batch_size * self.dp_size
        for chunk_start in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield microbatch_indices(
                chunk_start, 0, self.micro_batch_size, self.dp_rank, self.dp_size
            )

    def _iterations(self) -> Iterator[Tuple[int, int]]:
        """(first sample, global batch) of each whole iteration left."""
        batch_at = self.global_batch_size
        if not callable(batch_at):
            batch_at = lambda _, size=batch_at: size  # noqa: E731
        base = self.consumed_samples
        while base + batch_at(base) <= self.total_samples:
            yield base, batch_at(base)
            base += batch_at(base)

    def _by_iteration(self) -> Iterator[List[int]]:
        mbs = self.micro_batch_size
        for base, gbs in self._iterations():
            for j in range(microbatches_per_iteration(gbs, mbs, self.dp_rank, self.dp_size)):
                start = base + (j * self.dp_size + self.dp_rank) * mbs
                yield list(range(start, start + mbs))

    def __len__(self) -> int:
        if self.global_batch_size is not None and not callable(self.global_batch_size):
            iterations = max(
                0, (self.total_samples - self.consumed_samples) // self.global_batch_size
            )
            return iterations * microbatches_per_iteration(
                self.global_batch_size, self.micro_batch_size, self.dp_rank, self.dp_size
            )
        if self.global_batch_size is not None:
            return sum(
                microbatches_per_iteration(gbs, self.micro_batch_size, self.dp_rank, self.dp_size)
                for _, gbs in self._iterations()
            )
        step = self.micro_batch_size * self.dp_size
        return max(0, (self.total_samples - self.consumed_samples) // step)


def build_iterator(
    dataset,
    consumed_samples: int,
    config: Config,
    dp_rank: int,
    dp_size: int,
    on_cpu: bool,
    ramp: bool = True,
) -> Optional[Iterator]:
    """An iterator of collated microbatches, or None when there is no data.
    ramp: training's batches follow --rampup-batch-size; validation's are
    the full global batch (as Megatron-LM)."""
    if dataset is None:
        return None
    sampler = MicrobatchSampler(
        len(dataset),
        consumed_samples,
        config.batch.micro_batch_size,
        dp_rank,
        dp_size,
        GlobalBatch(config).at if ramp else config.batch.global_batch_size,
    )
    workers = config.data.num_workers
    # A private generator: building a loader draws a base seed, and drawing it
    # from the global stream would shift dropout whenever an iterator is
    # rebuilt (resume, validation, recovery).
    generator = torch.Generator().manual_seed(config.training.seed)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        pin_memory=not on_cpu,
        persistent_workers=False,
        prefetch_factor=2 if workers else None,
        generator=generator,
    )
    return iter(loader)

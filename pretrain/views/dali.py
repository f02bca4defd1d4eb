"""The DALI backend of `ViewLoader`: runs the view pipeline (`dali_pipeline`) for one rank.

It turns pipeline outputs into torch batches, keeps the loader's epochs aligned with the reader's,
and handles the one failure that is bad data rather than a bug: an image or mask the decoder
rejects mid-run (found by bisection, left out, pipeline rebuilt at the same batch).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import nvidia.dali.fn as fn
import nvidia.dali.types as types
import torch
from nvidia.dali import pipeline_def
from nvidia.dali.plugin.pytorch import feed_ndarray
from nvidia.dali.tensors import TensorListGPU
from torch.profiler import record_function

from relicv2.jobs.progress import tracked
from relicv2.jobs.workers import rank_cores
from relicv2.pretrain.views.backend import (
    BackendBatch,
    BackendSetup,
    assemble_params,
    labels_tensor,
)
from relicv2.pretrain.views.colour import Background, ColourDraws, colour_params, colour_views
from relicv2.pretrain.views.config import view_specs
from relicv2.pretrain.views.dali_pipeline import (
    READER_NAME,
    build_view_pipeline,
    output_names,
    soft_mask_views,
    view_output,
)
from relicv2.shards.reader import SampleRef
from relicv2.shards.sample import MASK_MEMBER, class_index
from relicv2.shards.sample_set import exclude_samples

DECODER_OPERATOR = "operator `nvidia.dali.fn.decoders.image`"  # how DALI names the decoder in its errors
# The stages of a batch as ranges in a torch.profiler trace (a profile of training shows where the
# views' time goes; `benchmarks/bench_views.py --profile` sums them per batch).
RANGE_RUN, RANGE_OUTPUTS, RANGE_COLOUR = "views: DALI run", "views: DALI outputs", "views: colour stage"
PROFILE_RANGES = (RANGE_RUN, RANGE_OUTPUTS, RANGE_COLOUR)


def find_undecodable(samples: Sequence[SampleRef], batch_size: int = 256, threads: int | None = None) -> dict[str, str]:
    """Keys of samples whose image or mask DALI's CPU decoder rejects, with a reason code.

    Decodes in batches on this rank's share of the cores (`threads`); a failing batch is bisected
    (a failed pipeline is unusable, so each try builds a new one). On a large set this is a pass of
    decoding (minutes for ImageNet), shown with progress.
    """
    threads = threads or rank_cores()
    bad: dict[str, str] = {}
    starts = range(0, len(samples), batch_size)
    for start in tracked(starts, "decoding every sample", len(starts), unit="batch", enabled=len(starts) > 8):
        _bisect_decode(list(samples[start : start + batch_size]), bad, threads)
    return bad


def is_decode_error(error: RuntimeError) -> bool:
    """True when a DALI pipeline error comes from its image decoder (bad data, not a bug).

    DALI reports any operator failure as a RuntimeError whose text names the operator ("Error in
    CPU operator `nvidia.dali.fn.decoders.image`", MIXED on a GPU); only the decoder's is a bad
    sample (image or mask), anything else must surface.
    """
    return DECODER_OPERATOR in str(error)


def _decodes(chunk: list[SampleRef], ext: str, threads: int) -> bool:
    data = [s.read_image() if ext == "image" else s.read(ext) for s in chunk]
    data = [d for d in data if d]
    if not data:
        return True

    @pipeline_def(batch_size=len(data), num_threads=max(1, min(threads, len(data))), device_id=None)
    def check():
        raw = fn.external_source(source=lambda: [np.frombuffer(d, np.uint8) for d in data], batch=True)
        return fn.decoders.image(raw, device="cpu", output_type=types.ANY_DATA)

    try:
        pipe = check()
        pipe.build()
        pipe.run()
        return True
    except RuntimeError as error:
        if is_decode_error(error):
            return False
        raise


def _bisect_decode(chunk: list[SampleRef], bad: dict[str, str], threads: int) -> None:
    for ext, reason in (("image", "undecodable_image"), (MASK_MEMBER, "bad_mask")):
        if _decodes(chunk, ext, threads):
            continue
        if len(chunk) == 1:
            bad[chunk[0].key] = reason
            return
        half = len(chunk) // 2
        _bisect_decode(chunk[:half], bad, threads)
        _bisect_decode(chunk[half:], bad, threads)
        return


def _to_torch(batch) -> torch.Tensor:
    """A DALI batch of equal-shape samples (float32 or uint8) as a torch tensor that owns its memory."""
    if isinstance(batch, TensorListGPU):
        dense = batch.as_tensor()
        dtype = torch.uint8 if dense.dtype == types.UINT8 else torch.float32
        out = torch.empty(dense.shape(), dtype=dtype, device="cuda")
        feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream())
        return out
    return torch.from_numpy(np.array(batch.as_tensor()))


def _host_array(batch) -> np.ndarray:
    """A DALI batch of equal-shape samples as a numpy array (copied from the GPU when it is there)."""
    return np.array(batch.as_cpu().as_tensor() if isinstance(batch, TensorListGPU) else batch.as_tensor())


def sample_key(source_info: str) -> str:
    """`shard.tar:offset:key.ext` (DALI's source info of a webdataset member) -> key."""
    member = source_info.rsplit(":", 1)[-1].rsplit("/", 1)[-1]
    return member.split(".", 1)[0]


class DaliBackend:
    """Runs the view pipeline for one rank and keeps its epochs aligned with the reader's.

    The reader yields the largest rank's share of samples per rank and epoch (padded), that is
    `runs_per_epoch` pipeline runs; the loader takes the first `batches_per_epoch` of them and
    `end_epoch` runs the rest, so the next batch is the first of the reader's next epoch.
    """

    def __init__(self, setup: BackendSetup) -> None:
        self.setup = setup
        self.samples = setup.samples
        self.specs = view_specs(setup.config)
        self.gpu = setup.device != "cpu"
        # Pipeline runs in the current reader epoch: restored with the reader (same ranks), or a new
        # reader at the start of its order (first start, or a position re-split over other ranks: then
        # the reader's epoch runs behind the loader's batch count until the loader's epoch ends).
        self.runs = int(setup.restore.get("runs", setup.batch_in_epoch)) if setup.restore else 0
        self._build(setup.restore["checkpoint"] if setup.restore else None)

    def _build(self, checkpoint: str | None) -> None:
        st = self.setup
        device_id = 0
        if self.gpu:
            device_id = int(st.device.split(":")[1]) if ":" in st.device else torch.cuda.current_device()
        self.pipe = build_view_pipeline(
            self.samples, st.config, batch_size=st.batch_size, gpu=self.gpu, rank=st.rank, world_size=st.world_size,
            seed=st.seed, device_id=device_id, checkpoint=checkpoint,
        )
        self.outputs = output_names(self.samples, st.config)
        # The views that may be masked: the pipeline gives their crops of the mask, and their flags are
        # counted (a few bytes from the GPU per batch).
        self.mask_views = soft_mask_views(self.samples, st.config)
        meta = self.pipe.reader_meta(READER_NAME)
        reader_epoch = meta["epoch_size_padded"] // meta["number_of_shards"]
        expected = -(-len(self.samples) // st.world_size)  # pad_last_batch: each rank reads the largest share
        if reader_epoch != expected:
            raise RuntimeError(f"DALI reads {reader_epoch} samples per rank, expected {expected}")
        self.runs_per_epoch = -(-reader_epoch // st.batch_size)

    def _recover(self, error: RuntimeError) -> dict[str, str]:
        """After a decode failure: find and leave out the undecodable samples, rebuild, and replay
        the current epoch up to the same batch. Costs one decode pass over the shard set plus the
        replayed batches; rare by construction (shards are verified when built). With several
        ranks, only the failing rank's epoch shrinks: keep verified shards for multi-rank runs."""
        bad = find_undecodable(self.samples.samples)
        if not bad:
            raise RuntimeError(f"the DALI decoder failed and no undecodable sample was found: {error}") from error
        warnings.warn(f"{self.samples.directory}: DALI could not decode {sorted(bad)}; left out, "
                      "replaying the epoch up to the current batch", stacklevel=3)
        exclude_samples(self.samples, bad)  # writes the filtered index files the rebuild reads
        self._build(None)
        for _ in range(self.runs):
            self.pipe.run()
        return bad

    def next_batch(self) -> BackendBatch:
        excluded: dict[str, str] = {}
        with record_function(RANGE_RUN):
            try:
                out = self.pipe.run()
            except RuntimeError as error:
                if not is_decode_error(error):
                    raise
                excluded = self._recover(error)
                out = self.pipe.run()
        self.runs += 1
        out = dict(zip(self.outputs, out, strict=True))
        v = range(len(self.specs))
        with record_function(RANGE_OUTPUTS):
            views = [_to_torch(out[view_output("view", j)]) for j in v]
            carrier, cls, coverage, grey = out["key"], out["cls"], out["coverage"], out["grey"]
            masked = [out[view_output("masked", j)] for j in v]
            keys = [sample_key(carrier[i].source_info()) for i in range(len(carrier))]
            labels = [class_index(np.asarray(cls[i]).tobytes()) for i in range(len(cls))]
            per_view = [_host_array(out[view_output("params", j)]) for j in v]
            backgrounds = self._backgrounds(out, masked, grey)  # {} unless views may be masked
        with record_function(RANGE_COLOUR):
            per_view = [colour_params(p, spec, self.setup.config) for p, spec in zip(per_view, self.specs, strict=True)]
            draws = [ColourDraws.from_params(p) for p in per_view]
            views = colour_views(views, draws, self.specs, self.setup.config, backgrounds)
        params = None
        if self.setup.config.debug_params:
            masked_flags = [_host_array(m) for m in masked]
            params = assemble_params(per_view, masked_flags, _host_array(coverage), _host_array(grey))
        masked_views = int(sum(_host_array(masked[j]).sum() for j in self.mask_views))
        return BackendBatch(views=views, keys=keys, labels=labels_tensor(labels), params=params, excluded=excluded,
                            masked_views=masked_views)

    def _backgrounds(self, out, masked, grey) -> dict[int, Background]:
        """{view: what the colour stage needs to mask it} for the views the pipeline gave a crop of the mask."""
        if not self.mask_views:
            return {}
        grey = _host_array(grey)
        return {j: Background(masked=_host_array(masked[j]) > 0.5, grey=grey, soft=_to_torch(out[view_output("soft", j)]))
                for j in self.mask_views}

    def end_epoch(self) -> None:
        # Batches the loader does not deliver (the reader's padded tail): run and drop them so
        # the next batch starts the reader's next epoch.
        while self.runs < self.runs_per_epoch:
            self.pipe.run()
            self.runs += 1
        self.runs = 0

    def state(self) -> dict:
        return {"checkpoint": self.pipe.checkpoint(), "runs": self.runs}

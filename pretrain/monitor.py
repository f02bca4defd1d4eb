"""The kNN monitor of a pretraining run: its shard sets checked before the first step, and the kNN accuracy
of the online encoder at epoch ends (`pretrain.knn`), logged beside the training metrics."""

from __future__ import annotations

from relicv2.jobs.config import ConfigError
from relicv2.pretrain.config import PretrainConfig
from relicv2.pretrain.distributed import DistributedContext
from relicv2.pretrain.knn.classes import ClassMismatchError, check_same_classes
from relicv2.pretrain.knn.classify import evaluate_knn, shared_tars
from relicv2.pretrain.knn.outcome import lost_fields
from relicv2.pretrain.metrics_log import MetricsLogger
from relicv2.pretrain.trainer import TrainState
from relicv2.shards.reader import ReadReport, iter_samples
from relicv2.shards.sample import label_refusal
from relicv2.shards.shardset import ShardSet


def check_monitor_sets(bank: ShardSet, queries: ShardSet, train: ShardSet | None) -> None:
    """Refuse (ConfigError) a monitor whose sets are unlabelled, number their classes differently, or whose
    queries are in its bank; warn when its queries are trained on (`train`: the training set, if shards)."""
    _check_first_label("knn.train_shards", bank)
    _check_first_label("knn.val_shards", queries)
    try:
        check_same_classes(bank, queries)
    except ClassMismatchError as error:
        raise ConfigError(f"knn.train_shards / knn.val_shards: {error}") from None
    both = shared_tars(bank, queries)
    if both:
        raise ConfigError(f"knn.train_shards and knn.val_shards share {len(both)} tar(s) ({both[0].name}, ...): the "
                          "monitor would find each query in its own bank; set knn.val_shards to a held-out labelled set")
    if train is not None and shared_tars(train, queries):
        print(f"warning: knn.val_shards={queries} holds images of data.train_shards: the kNN monitor scores "
              "images the encoder trains on; a held-out labelled set gives a figure that generalises", flush=True)


def _check_first_label(key: str, spec: ShardSet) -> None:
    """The kNN sets' first sample must carry a class index: an unlabelled set (or one with class names
    in `cls`) would otherwise stop the run at its first epoch end, hours in."""
    sample = next(iter_samples(spec, report=ReadReport()), None)
    if sample is None:
        raise ConfigError(f"{key}={spec}: no readable sample; check the shard set (relicv2 shards verify)")
    if sample["label"] is None:
        raise ConfigError(f"{key}={spec}: {label_refusal(sample['key'], sample.get('label_text'), 'the kNN monitor')}, "
                          "or set knn.train_shards= to turn the monitor off")


def knn_monitor(state: TrainState, config: PretrainConfig, ctx: DistributedContext, logger: MetricsLogger | None,
                bank: ShardSet, queries: ShardSet) -> None:
    """kNN accuracy of the online encoder: every rank extracts and searches 1/W of the bank, rank 0
    merges the ranks' nearest, classifies and logs (so the wait stays short on large labelled sets)."""
    # A monitor never stops a training: a set that loses samples is scored on what remains, and the
    # loss is logged (`knn_lost`) and said (`relicv2 eval knn` refuses such a set instead).
    result = evaluate_knn(state.online.encoder, bank, queries, settings=config.knn,
                          device=ctx.device, ctx=ctx, allow_lost=True)
    if result is not None and logger is not None:
        lost = lost_fields(result.lost)["lost"]
        logger.log(state.step, {"knn_top1": result.top1, "knn_skipped": float(result.skipped), "knn_lost": float(lost)})
        logger.message(f"step {state.step}: kNN top-1 {result.top1:.4f} ({result.num_train} bank, {result.num_val} val)")
        for entry in result.lost:
            logger.message(f"warning: the kNN monitor's set {entry.source} lost samples while being read "
                           f"({entry.detail}); scored without them: check it with `relicv2 shards verify "
                           f"{entry.source}` and rebuild it")

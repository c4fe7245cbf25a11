"""Profiled calibration: op, collective and segment-pair times measured on the live device and group.

:class:`ProfiledEstimator` answers ``node_cost`` like its base estimator, with measured times
wherever it measured the node's signature; every rank measures the same signatures and keeps the
max over ranks, so every rank plans the same schedule. Its pieces, each a module::

    estimator     ProfiledEstimator, CalibrationReport: calibrate(), measured node costs,
                  link / compute scales for what was not measured
    signatures    what a measurement is keyed by (the same on every rank of an SPMD graph)
    cache         the disk cache of compute signatures, one JSON file per device (device_key)
    running       running one node alone on real tensors; device_of_nodes (median_run_s: cost_model.timing)
    contention    the compute slowdown while a transfer is in flight (an all_reduce or an all_to_all)
    threads       the threads that move transfers (gloo's), their CPU, and the cores the compute has
    pairs         two segments co-executed: the interleave pass's measured P(F_i, B_j)

Ranks agree through :mod:`cost_model.rank_agreement`; the progress bar is
:mod:`cost_model.progress`.
"""

from __future__ import annotations

from cost_model.profile.cache import device_key
from cost_model.profile.estimator import CalibrationReport, ProfiledEstimator
from cost_model.timing import median_run_s

__all__ = ["CalibrationReport", "ProfiledEstimator", "device_key", "median_run_s"]

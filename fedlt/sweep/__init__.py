"""Studies: a grid of runs (``fedlt sweep``), run by an executor, resumable, optionally tracked.

``study`` reads a study and plans its directory, ``executors`` runs the runs (local processes,
Ray, Slurm), ``track`` logs them to MLflow or TensorBoard, ``runner.sweep`` ties them together;
``fedlt.report`` aggregates a finished study over its seeds (docs/sweeps.md).
"""

from fedlt.sweep.executors import EXECUTORS, Job, Outcome, run_job
from fedlt.sweep.runner import SweepResult, sweep
from fedlt.sweep.study import Study, expand, load_study, read_manifest

__all__ = ["EXECUTORS", "Job", "Outcome", "Study", "SweepResult", "expand", "load_study", "read_manifest",
           "run_job", "sweep"]

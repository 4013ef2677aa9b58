"""Imports every command module so that each registers itself on the app."""

from fedlt.cli import doctor_cmd, list_cmd, partition_cmd, report_cmd, run_cmd, splits_cmd, sweep_cmd  # noqa: F401

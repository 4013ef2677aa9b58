"""Compare finished (or stopped) runs, and aggregate a study over its seeds; one module per job:

    runs      a run directory read and checked (``load_run``, ``read_runs``), the comparison table
    study     a study's cells, each metric's mean ± std over seeds, the layout, reference values
    formats   the study's table as Markdown, CSV, LaTeX or JSON, escaping what it copies
    plots     accuracy curves, per-class and many/medium/few bars, per-client boxes, partition
              heatmaps, as PNG files
    html      one self-contained HTML page of runs or of a study (tables, figures, config, versions)

Every file written goes through ``fedlt.outputs``: never over a file fedlt did not write, never
over an input (docs/runs.md, docs/sweeps.md). The names below are the public face (``from
fedlt.report import load_runs, render_study, ...``).
"""

from fedlt.report.formats import (StudyTable, csv_cell, format_stat, latex_escape, markdown_escape, prepare_study,
                                  render_study, render_table, study_table)
from fedlt.report.html import run_page, study_page
from fedlt.report.plots import STUDY_PLOTS, plot_accuracy, plot_per_class, plot_per_client, plot_study, write_plots
from fedlt.report.runs import (NUMBER_FIELDS, Run, is_accuracy, load_run, load_runs, participation_rows,
                               participation_table, per_client_lines, per_client_rows, per_client_table, read_runs,
                               rows, table, table_lines)
from fedlt.report.study import (DECIMALS, FORMATS, RUN_METRICS, STUDY_METRICS, Cell, Reference, aggregate,
                                check_metrics, is_study, layout, load_study, metric_value, read_reference)

__all__ = ["Cell", "DECIMALS", "FORMATS", "NUMBER_FIELDS", "RUN_METRICS", "Reference", "Run", "STUDY_METRICS", "STUDY_PLOTS",
           "StudyTable", "aggregate", "check_metrics", "csv_cell", "format_stat", "is_accuracy", "is_study",
           "latex_escape", "layout", "load_run", "load_runs", "load_study", "markdown_escape", "metric_value",
           "participation_rows", "participation_table", "per_client_lines", "per_client_rows", "per_client_table",
           "plot_accuracy", "plot_per_class", "plot_per_client", "plot_study", "prepare_study", "read_reference",
           "read_runs", "render_study", "render_table", "rows", "run_page", "study_page", "study_table", "table", "table_lines",
           "write_plots"]

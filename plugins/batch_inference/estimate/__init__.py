"""The preview before any spend, and the pilot that measures what it cannot count.

* :func:`preview` reads the source as the submit does, writes nothing, renders
  every record's prompt as the worker does and counts it with the pinned
  model's own tokenizer (``tokens``), and projects GPU-hours, the bill by
  transport, the finish against the deadline and the budget, from measured
  rates (``preview.py``).
* :func:`run_pilot` runs N records drawn from the source through the real
  worker into a scratch version that is dropped afterwards, and keeps what it
  measured in ``bi.estimate_pilots`` (``pilot.py``).
* :func:`pilot_figures` is the newest pilot of a spec's model, which
  ``capacity --spec`` uses in place of its assumed shapes.

The CLI (``commands/estimate.py``), the DAG task (``operators/estimate.py``)
and the dashboard call these; none of them computes a figure of its own.
"""

from batch_inference.estimate.pilot import run_pilot, scratch_spec
from batch_inference.estimate.preview import (VERDICTS, Preview, default_workers, judge, measured, pilot_figures,
                                              preview, render, source_rows)
from batch_inference.estimate.tokens import CharEstimate, Counter, counter_for

__all__ = ["VERDICTS", "CharEstimate", "Counter", "Preview", "counter_for", "default_workers", "judge", "measured",
           "pilot_figures", "preview", "render", "run_pilot", "scratch_spec", "source_rows"]

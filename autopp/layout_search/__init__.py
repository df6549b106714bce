"""Configuration search: the fastest pp × dp × tp, schedule, microbatches, split and
recomputation for a model on a number of devices (:func:`search`)."""

from autopp.layout_search.layouts import DEFAULT_SCHEDULES, Layout, enumerate_layouts
from autopp.layout_search.search import Candidate, SearchReport, search

__all__ = ["DEFAULT_SCHEDULES", "Candidate", "Layout", "SearchReport", "enumerate_layouts",
           "search"]

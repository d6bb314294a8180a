"""The figures' shared style (matplotlib, the ``plot`` extra): :data:`COLORS`, :func:`bar_chart`, :func:`new_figure`,
:func:`save`."""

from ._inspect.plotting import COLORS, bar_chart, new_figure, save

__all__ = ["COLORS", "bar_chart", "new_figure", "save"]

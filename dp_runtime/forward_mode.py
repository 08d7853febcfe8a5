"""ForwardMode, re-exported from graph/ (the lower layer defines it so graph/ can compare it)."""

from graph.forward_mode import ForwardMode

__all__ = ["ForwardMode"]

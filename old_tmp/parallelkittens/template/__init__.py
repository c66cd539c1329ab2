"""The LCSC persistent-kernel template (see `lcsc`)."""

from .lcsc import grid, lcsc

__all__ = ["grid", "lcsc"]

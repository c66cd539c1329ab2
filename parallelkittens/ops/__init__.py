"""Ops built on the primitives and the template, one module each."""

from .barrier import barrier

__all__ = ["barrier"]

"""Collectives: one pull kernel (`_pull.py`) described by a copy per op."""

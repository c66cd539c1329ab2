"""Attention: the flash-attention core and its sequence-parallel forms (ring, Ulysses)."""

"""Triton kernels and their torch reference twins.

Kept import-light on purpose: transformers probes for a top-level package
named ``kernels`` and imports it while building models.
"""

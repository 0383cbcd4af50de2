"""Speculative decoding in the worker: n-gram drafts, and their verification."""

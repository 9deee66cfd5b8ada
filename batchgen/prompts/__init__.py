"""Rows to requests: rendering, per-row settings, parts cut into requests."""

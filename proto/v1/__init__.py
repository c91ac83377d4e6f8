"""Stubs generated from shoal.proto (package shoal.v1)."""

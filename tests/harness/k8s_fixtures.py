"""Fixtures for the real control plane (filled in by the control-plane work)."""

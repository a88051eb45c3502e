"""Fixtures for a real local Ray head (filled in by the trainer work)."""

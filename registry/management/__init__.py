"""The registry's management commands."""

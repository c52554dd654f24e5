"""The jobs app's management commands."""

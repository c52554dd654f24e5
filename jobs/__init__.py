"""Calibration files, estimates, jobs, events, and the workers that run the pipeline (a Django app)."""

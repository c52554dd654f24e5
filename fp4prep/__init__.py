"""fp4prep: prepare LoRA adapters for FP4 serving (Django project package and pipeline library)."""

__version__ = "0.1.0"

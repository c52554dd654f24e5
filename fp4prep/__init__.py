"""fp4prep: prepare LoRA adapters for FP4 serving.

The product a script imports: ``pipeline`` (merge, calibrate, quantize, export, validate; no
Django), ``client`` and ``cli`` (the Python client and the ``fp4prep`` command), ``demo`` (the
embedded default's assets, built offline) and the small helpers they share (``text``, ``hashing``,
``statuses``). ``site`` is the Django project that serves the product (settings, URLs, WSGI and
the HTTP helpers the ``registry`` and ``jobs`` apps share); nothing outside it imports Django.
"""

__version__ = "0.1.0"

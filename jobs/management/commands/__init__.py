"""``manage.py runworker``, ``rundemo`` and ``baseshapes``."""

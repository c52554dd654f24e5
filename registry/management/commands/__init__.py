"""``manage.py catalogue`` and ``manage.py createproject``."""

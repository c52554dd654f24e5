"""WSGI entry point for production servers (gunicorn fp4prep.site.wsgi)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fp4prep.site.settings")
application = get_wsgi_application()

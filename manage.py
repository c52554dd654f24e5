#!/usr/bin/env python
"""Django's command-line utility for fp4prep's service."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fp4prep.site.settings")
    try:
        from django.core.management import execute_from_command_line
    except ImportError:
        print("error: manage.py runs the service, which needs Django: pip install 'fp4prep[service]'", file=sys.stderr)
        sys.exit(2)

    execute_from_command_line(sys.argv)

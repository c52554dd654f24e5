"""The Django project: settings, URLs and WSGI, and what the ``registry`` and ``jobs`` apps share
over HTTP (the API's error envelope and upload limits, the dashboard's project pages, middleware,
service errors, IDs). The only part of ``fp4prep`` that imports Django or the apps."""

"""fp4prep's Django settings, read from the environment (docs/operations.md).

Defaults are the embedded setup: SQLite and django-q2's ORM broker under ``var/``, one CPU worker
slot, plain HTTP on localhost, DEBUG off. Production sets DATABASE_URL, FP4PREP_BROKER_URL,
FP4PREP_SECRET_KEY, FP4PREP_HTTPS=1 and FP4PREP_ALLOWED_HOSTS; ``manage.py check --deploy`` is then clean.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from .env import env_bool, env_choice, env_float, env_int, env_list, env_path, env_str, secret_key_file

BASE_DIR = Path(__file__).resolve().parents[2]
VAR_DIR = env_path("FP4PREP_VAR_DIR", BASE_DIR / "var")

# Off unless asked for: Django's debug pages show settings and source to whoever hits an error.
DEBUG = env_bool("FP4PREP_DEBUG", False)
# A key of this installation's own, made on first start and kept in var/, when none is given;
# web processes on several machines must share one, so production sets FP4PREP_SECRET_KEY.
SECRET_KEY = env_str("FP4PREP_SECRET_KEY") or secret_key_file(VAR_DIR / "secret_key")
SECRET_KEY_GENERATED = not env_str("FP4PREP_SECRET_KEY")
ALLOWED_HOSTS = env_list("FP4PREP_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("FP4PREP_CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "axes",
    "django_q",
    "django_htmx",
    "template_partials",
    "registry",
    "jobs",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "fp4prep.site.middleware.ContentSecurityPolicy",  # on every page, error pages included
    "fp4prep.site.addresses.DirectClients",  # warns when trusted proxies are set and a request bypassed them
    "whitenoise.middleware.WhiteNoiseMiddleware",  # the dashboard's CSS and htmx, without a separate web server
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "fp4prep.site.middleware.BodyLimit",  # before the CSRF check, which reads the body
    "fp4prep.site.middleware.OutOfMemory",  # a MemoryError in a view: 413, never a 500
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # Last, as django-axes asks: it turns a locked-out sign-in into its own answer.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "fp4prep.site.urls"
WSGI_APPLICATION = "fp4prep.site.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            # {% partialdef %} in every template: pages and the parts HTMX swaps live in one file.
            "builtins": ["template_partials.templatetags.partials", "fp4prep.site.filters"],
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "fp4prep.site.pages.context",
            ]
        },
    }
]

# --- Database: DATABASE_URL, default SQLite under var/ -----------------------------------------------
DATABASE_URL = env_str("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'fp4prep.sqlite3'}"
try:
    _db = dj_database_url.parse(DATABASE_URL, conn_max_age=env_int("FP4PREP_DB_CONN_MAX_AGE", 0, minimum=0))
except ValueError as exc:
    raise ImproperlyConfigured(f"DATABASE_URL={DATABASE_URL!r}: {exc}") from None
if _db["ENGINE"] == "django.db.backends.sqlite3":
    # Web requests, the worker cluster and its heartbeat all write: WAL lets readers go on, IMMEDIATE
    # takes the write lock at BEGIN so two credit holds serialize instead of failing mid-transaction.
    _db["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    Path(_db["NAME"]).parent.mkdir(parents=True, exist_ok=True)
    # A file, not memory: the test worker is another process and must see the same database.
    _db["TEST"] = {"NAME": str(Path(_db["NAME"]).with_name("test-" + Path(_db["NAME"]).name))}
DATABASES = {"default": _db}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Files ---------------------------------------------------------------------------------------
# Artifacts: calibration files, adapter and prepared revisions, job work directories. In production a
# shared filesystem path every web process and worker mounts at the same place.
ARTIFACT_ROOT = env_path("FP4PREP_ARTIFACT_ROOT", VAR_DIR / "artifacts")
# Where workers find the BF16 weights of catalogue entries (SupportedBase.weights_location).
WEIGHTS_ROOT = env_path("FP4PREP_WEIGHTS_ROOT", VAR_DIR / "weights")
CALIBRATION_MAX_BYTES = env_int("FP4PREP_CALIBRATION_MAX_BYTES", 64 * 1024 * 1024, minimum=1)
ADAPTER_MAX_BYTES = env_int("FP4PREP_ADAPTER_MAX_BYTES", 8 * 1024**3, minimum=1)
ADAPTER_MAX_FILES = env_int("FP4PREP_ADAPTER_MAX_FILES", 1000, minimum=1)  # members: files and directories
# What matching an adapter's rank_pattern / alpha_pattern keys to its modules may cost at upload:
# (regular-expression keys + forms of plain keys) x modules, each one lookup or match.
ADAPTER_PATTERN_MAX_STEPS = env_int("FP4PREP_ADAPTER_PATTERN_STEPS", 200_000, minimum=1)
# What one project's uploads (adapter revisions, calibration files) may take on the artifact store.
PROJECT_STORAGE_BYTES = env_int("FP4PREP_PROJECT_STORAGE_BYTES", 50 * 1024**3, minimum=1)
FILE_UPLOAD_MAX_MEMORY_SIZE = 4 * 1024 * 1024
# Every other request body (JSON, forms): refused past this before it is read.
REQUEST_MAX_BYTES = env_int("FP4PREP_REQUEST_MAX_BYTES", 1024 * 1024, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = REQUEST_MAX_BYTES

# --- Workers (django-q2) ---------------------------------------------------------------------------
WORKER_KIND = env_choice("FP4PREP_WORKER_KIND", "cpu", ("cpu", "gpu"))
WORKER_SLOTS = env_int("FP4PREP_WORKER_SLOTS", 1, minimum=1)
WORKER_NAME = env_str("FP4PREP_WORKER_NAME")  # default: host:pid
# Where a worker's jobs compute: auto (a CUDA device when there is one), cpu, cuda or cuda:N.
WORKER_DEVICE = env_str("FP4PREP_WORKER_DEVICE", "auto").lower()
if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", WORKER_DEVICE):
    raise ImproperlyConfigured(f"FP4PREP_WORKER_DEVICE={WORKER_DEVICE!r} must be auto, cpu, cuda or cuda:N")
# A job that ended in error keeps what it finished (calibrated layers, the export) this long, so
# that support's requeue continues from there instead of from zero.
RESUME_KEEP_HOURS = env_float("FP4PREP_RESUME_KEEP_HOURS", 72.0, minimum=0.0)
HEARTBEAT_INTERVAL = env_float("FP4PREP_HEARTBEAT_INTERVAL", 10.0, minimum=0.1)
HEARTBEAT_TIMEOUT = env_float("FP4PREP_HEARTBEAT_TIMEOUT", 120.0, minimum=0.1)
JOB_TIMEOUT = env_int("FP4PREP_JOB_TIMEOUT", 48 * 3600, minimum=60)
BROKER_URL = env_str("FP4PREP_BROKER_URL")  # empty: django-q2's ORM broker in DATABASE_URL
QUEUE_PREFIX = env_str("FP4PREP_QUEUE_PREFIX", "fp4prep")

Q_CLUSTER: dict[str, object] = {
    "name": "fp4prep",  # the signing salt of queued tasks: the same for every queue
    # One queue per worker kind: GPU workers take only GPU jobs. Enqueueing names the job's queue.
    "cluster_name": f"{QUEUE_PREFIX}-{WORKER_KIND}",
    "workers": WORKER_SLOTS,
    "timeout": JOB_TIMEOUT,
    "retry": JOB_TIMEOUT + 600,
    "max_attempts": 2,
    "recycle": 1,  # a fresh process per job: nothing of one job's torch state leaks into the next
    "ack_failures": True,
    "catch_up": False,
    "poll": 0.5,
    "save_limit": 200,
    "label": "Worker tasks",
}
if BROKER_URL:
    if not BROKER_URL.startswith(("redis://", "rediss://", "unix://")):
        raise ImproperlyConfigured(f"FP4PREP_BROKER_URL={BROKER_URL!r} must be a redis:// URL (or empty for the ORM broker)")
    Q_CLUSTER["redis"] = BROKER_URL
else:
    Q_CLUSTER["orm"] = "default"

# --- Sign-in and rate limits -------------------------------------------------------------------------
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # refuses sign-ins while a username/address pair is locked out
    "django.contrib.auth.backends.ModelBackend",
]
# Five failed sign-ins for one username from one address lock that pair out for 15 minutes.
AXES_FAILURE_LIMIT = env_int("FP4PREP_SIGNIN_FAILURES", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_float("FP4PREP_SIGNIN_LOCKOUT_MINUTES", 15.0, minimum=0.1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
# The address the API's rates use (trusted proxies honoured), not the proxy's own.
AXES_CLIENT_IP_CALLABLE = "fp4prep.site.addresses.client_address"
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "locked_out.html"
AXES_VERBOSE = False
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 10}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Requests per API key, e.g. 1200/min; counted in the cache, which several web processes must share.
API_RATE = env_str("FP4PREP_API_RATE", "1200/min")
# All of a project's keys together (keys are free to mint).
API_PROJECT_RATE = env_str("FP4PREP_API_PROJECT_RATE", "3000/min")
# Per client address, for requests without a valid key: the schema, a missing or wrong key.
API_ADDRESS_RATE = env_str("FP4PREP_API_ADDRESS_RATE", "120/min")
for _name, _rate in (("API_RATE", API_RATE), ("API_PROJECT_RATE", API_PROJECT_RATE), ("API_ADDRESS_RATE", API_ADDRESS_RATE)):
    if not re.fullmatch(r"\d+/(s|sec|m|min|h|hour|d|day)", _rate):
        raise ImproperlyConfigured(f"FP4PREP_{_name}={_rate!r} must be a count per time, e.g. 1200/min")
# Proxies in front of the web processes that set X-Forwarded-For (0: clients connect directly, and
# their addresses are the sockets' peers; a header they send is not believed).
TRUSTED_PROXIES = env_int("FP4PREP_TRUSTED_PROXIES", 0, minimum=0)
CACHE_URL = env_str("FP4PREP_CACHE_URL", BROKER_URL)
if CACHE_URL:
    if not CACHE_URL.startswith(("redis://", "rediss://", "unix://")):
        raise ImproperlyConfigured(f"FP4PREP_CACHE_URL={CACHE_URL!r} must be a redis:// URL (or empty for memory)")
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": CACHE_URL, "KEY_PREFIX": QUEUE_PREFIX}}
else:  # the embedded setup: one web process
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# --- REST API --------------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["registry.auth.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["registry.auth.HasProject"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": [
        "fp4prep.site.parsers.JSONParser",
        "rest_framework.parsers.MultiPartParser",
        "rest_framework.parsers.FormParser",
    ],
    "DEFAULT_PAGINATION_CLASS": "fp4prep.site.rest.Pagination",
    "PAGE_SIZE": 20,
    "EXCEPTION_HANDLER": "fp4prep.site.rest.exception_handler",
    "DEFAULT_THROTTLE_CLASSES": ["registry.auth.PerKeyThrottle", "registry.auth.PerProjectThrottle", "registry.auth.AddressThrottle"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "fp4prep API",
    "DESCRIPTION": "Prepare LoRA adapters for FP4 inference: registry, calibration files and jobs.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # The docs page's Swagger UI comes from this app's static files, never a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "ENUM_NAME_OVERRIDES": {
        "JobStatusEnum": "jobs.models.Job.Status",
        "FileStatusEnum": "jobs.models.CalibrationFile.Status",
    },
}

# --- Web -------------------------------------------------------------------------------------------
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = env_path("FP4PREP_STATIC_ROOT", VAR_DIR / "static")
# Served from the finders too, so a fresh checkout works without collectstatic (production runs it).
WHITENOISE_USE_FINDERS = True
# Nothing is served as media; a prefix of its own keeps every other path away from media serving
# (Django's test server would otherwise look each request up as a file first).
MEDIA_URL = "/media/"
# Error reports (the debug page, mails to admins) hide URLs that carry passwords too.
DEFAULT_EXCEPTION_REPORTER_FILTER = "fp4prep.site.pages.SettingsFilter"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

# Served over HTTPS (directly or behind a TLS proxy): cookies only over TLS, HSTS, redirects to https.
# Off for the embedded setup, which serves plain HTTP on localhost.
HTTPS = env_bool("FP4PREP_HTTPS", False)
if HTTPS:
    SECURE_SSL_REDIRECT = env_bool("FP4PREP_SSL_REDIRECT", True)
    SECURE_HSTS_SECONDS = env_int("FP4PREP_HSTS_SECONDS", 31536000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    if env_bool("FP4PREP_BEHIND_PROXY", False):
        SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("FP4PREP_LOG_LEVEL", "INFO")},
    "loggers": {
        "django_q": {"level": env_str("FP4PREP_QUEUE_LOG_LEVEL", "WARNING"), "propagate": True},
        "axes": {"level": "WARNING", "propagate": True},
    },
}

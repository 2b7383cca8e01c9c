"""A task module that only the workers can import: it needs a secret they alone have, and
raises ImproperlyConfigured (not ImportError) anywhere else, as settings-reading modules do.
Nothing imports it but tests/integration/test_tasks.py, through a stored result's path."""

from django.core.exceptions import ImproperlyConfigured

raise ImproperlyConfigured("set STRIPE_KEY: this module runs on the billing workers only")

"""``path("outbox/", include("django_outbox.urls"))`` serves ``outbox/health/``."""

from django.urls import path

from . import views

app_name = "django_outbox"
urlpatterns = [path("health/", views.health, name="health")]

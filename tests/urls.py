from django.contrib import admin
from django.urls import include, path
from health_check.views import HealthCheckView

urlpatterns = [
    path("admin/", admin.site.urls),
    path("outbox/", include("django_outbox.urls")),
    path(
        "health-check/",
        HealthCheckView.as_view(checks=[("django_outbox.healthcheck.OutboxHealthCheck", {})]),
    ),
]

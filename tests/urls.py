from django.contrib import admin
from django.urls import include, path
from health_check.views import HealthCheckView

from tests.testapp import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("orders/", views.place_order, name="place-order"),
    path("tasks/add/", views.enqueue_add, name="enqueue-add"),
    path("outbox/", include("django_outbox.urls")),
    path(
        "health-check/",
        HealthCheckView.as_view(checks=[("django_outbox.healthcheck.OutboxHealthCheck", {})]),
    ),
]

from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "example_project.billing"
    label = "billing"
    verbose_name = "Billing"

"""Transports publish claimed messages: kombu (RabbitMQ, Redis, filesystem, memory ...), Celery."""

from __future__ import annotations

from .base import Failure, Outcome, Transport

__all__ = ["Failure", "Outcome", "Transport"]

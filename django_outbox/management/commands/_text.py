"""The one-line texts of the commands live in the library (:mod:`django_outbox.text`)."""

from django_outbox.text import MAX_LINE, duration, one_line

__all__ = ["MAX_LINE", "duration", "one_line"]

"""What every long-running outbox process (a relay, a consumer) shares.

:mod:`.heartbeat` keeps each process's row saying it is alive, :mod:`.samples` takes
the once-a-minute sample behind the admin's chart from the relays' heartbeats, and
:mod:`.outage` logs an outage of a broker, a queue or the database once when it starts
and once when it ends, and says when to try again; :mod:`.connections` closes the
database connection a run leaves behind in its thread. It may import the row's life
(:mod:`django_outbox.state`), the models, the database layer, the settings and the
leaves; the relay and the consumer build on it.
"""
